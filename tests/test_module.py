"""GPTModule's own gradient clipping and optimizer choice (Lightning's are bypassed), its
graphed and compiled steps, and what its training logs for the progress bar."""

from types import SimpleNamespace

import pytest
import torch

from fusedtrain.model import GPT, GPTConfig
from fusedtrain.optim import AdamW
from fusedtrain.training.lightning_module import GPTModule
from fusedtrain.training.optimizer import OptimConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _module_with_grads(precision: str = "32-true") -> GPTModule:
    cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16)
    module = GPTModule(cfg, OptimConfig(), max_steps=10)
    module.trainer = SimpleNamespace(strategy=SimpleNamespace(model=module), precision=precision)
    idx = torch.randint(0, 64, (2, 16))
    (module.model.loss(idx, idx) * 1e3).backward()
    return module


def _grad_norm(module: GPTModule) -> float:
    return torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in module.parameters()])).item()


def test_norm_clipping_scales_the_gradients_to_the_limit():
    module = _module_with_grads()
    assert _grad_norm(module) > 1.0
    module.configure_gradient_clipping(None, gradient_clip_val=1.0)
    assert _grad_norm(module) == pytest.approx(1.0, rel=1e-4)


def test_value_clipping_and_no_clipping():
    module = _module_with_grads()
    before = [p.grad.clone() for p in module.parameters()]
    module.configure_gradient_clipping(None, gradient_clip_val=None)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, module.parameters()))
    module.configure_gradient_clipping(None, gradient_clip_val=0.01,
                                       gradient_clip_algorithm="value")
    assert max(p.grad.abs().max().item() for p in module.parameters()) <= 0.01


def test_fused_adamw_only_on_cuda_and_never_under_fp16_scaling():
    module = _module_with_grads()
    assert not module._adamw_plan().torch_fused  # CPU parameters
    if torch.cuda.is_available():
        module.cuda()
        assert module._adamw_plan().torch_fused
        module.trainer.precision = "16-mixed"
        assert not module._adamw_plan().torch_fused


@pytest.mark.parametrize("kernels, run, precision, expected", [
    ({}, "plain", "bf16-mixed", (False, None)),  # eager ops: torch's AdamW
    ({"mlp": True}, "plain", "bf16-mixed", (True, torch.bfloat16)),
    ({"mlp": True}, True, "bf16-mixed", (True, torch.bfloat16)),  # ops.published_cast
    ({"mlp": True}, "reduce-overhead", "bf16-mixed", (True, None)),  # Inductor's graphs cast
    ({"mlp": True}, "cuda_graph", "bf16-mixed", (True, None)),  # the graphs hold casts
    ({"mlp": True}, "plain", "32-true", (True, None)),
])
def test_fused_ops_step_with_fusedtrain_adamw_writing_copies_where_read(
        monkeypatch, kernels, run, precision, expected):
    cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16,
                    kernels=kernels)
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None: fn)
    module = GPTModule(cfg, OptimConfig(), max_steps=10,
                       compile=run if run not in ("plain", "cuda_graph") else False,
                       cuda_graph=run == "cuda_graph")
    module.trainer = SimpleNamespace(strategy=SimpleNamespace(model=module), precision=precision)
    monkeypatch.setattr(module, "_on_cuda", lambda: True)  # as on CUDA
    plan = module._adamw_plan()
    assert (plan.ours, plan.copy_dtype) == expected
    opt = module.configure_optimizers()["optimizer"]
    assert isinstance(opt, AdamW) == expected[0]
    assert getattr(opt, "copy_dtype", None) == expected[1]


@pytest.mark.parametrize("layernorm", [False, True])
def test_the_graphed_pieces_chain_to_the_model_loss(monkeypatch, layernorm):
    """cuda_graph=true's chain of pieces (embedding, blocks, head) computes model.loss and
    its gradients; with the fused LayerNorm each block also hands the next its MLP's
    output bias. Here the pieces run eagerly (a stand-in for GraphChain); on a GPU
    tests/test_graph_chain.py replays the real graphs and tests/test_cuda_graph.py trains
    with them."""
    import fusedtrain.training.graph_capture as capture_mod

    captured = {}
    monkeypatch.setattr(capture_mod, "GraphChain", _eager_chain(captured))
    cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=3, n_head=2, n_embd=16,
                    kernels={"layernorm": layernorm})
    model = GPT(cfg).to(DEVICE)  # the fused kernels' device
    idx = torch.randint(0, 64, (2, 16), device=DEVICE)
    targets = torch.randint(0, 64, (2, 16), device=DEVICE)
    graphed = capture_mod.GraphedLoss(model, idx, targets, split=True)
    # A graph returns gradients only for the parameters its piece registers: every
    # parameter must be registered by the pieces that use it (the tied wte by two).
    registered = [{id(p) for p in piece.parameters()} for piece in captured["pieces"]]
    assert set().union(*registered) == {id(p) for p in model.parameters()}
    wte = id(model.transformer.wte.weight)
    assert wte in registered[0] and wte in registered[-1]

    loss = graphed(idx, targets)
    # embedding, first block (stream only), two blocks (stream, delta[, delta_bias]),
    # head (targets first)
    n = 3 if layernorm else 2
    assert captured["inputs"] == [1, 1, n, n, n + 1]
    grads = torch.autograd.grad(loss, list(model.parameters()))
    expected = model.loss(idx, targets)
    torch.testing.assert_close(loss, expected)
    for g, e in zip(grads, torch.autograd.grad(expected, list(model.parameters()))):
        torch.testing.assert_close(g, e)

    # Unsplit (one process): one piece, the whole loss over every parameter.
    graphed = capture_mod.GraphedLoss(model, idx, targets, split=False)
    assert {id(p) for p in captured["pieces"][0].parameters()} == \
        {id(p) for p in model.parameters()}
    torch.testing.assert_close(graphed(idx, targets), expected)
    assert captured["inputs"] == [2]


def _eager_chain(captured: dict):
    """A stand-in for GraphChain that runs its pieces eagerly (no CUDA graphs on CPU),
    recording the pieces and how many inputs each received."""

    class EagerChain:
        def __init__(self, pieces, extras):
            captured["pieces"] = self.pieces = pieces
            captured["captures"] = captured.get("captures", 0) + 1

        def __call__(self, *extras):
            outs, captured["inputs"] = (), []
            for piece, piece_extras in zip(self.pieces, extras, strict=True):
                captured["inputs"].append(len(piece_extras) + len(outs))
                out = piece(*piece_extras, *outs)
                outs = out if isinstance(out, tuple) else (out,)
            return outs

    return EagerChain


def test_graphed_training_loss_is_captured_once_and_falls_back_on_other_shapes(monkeypatch):
    """GPTModule with cuda_graph=True: the first step captures, later steps of that batch
    shape replay the same pieces, another shape runs the plain loss (the pieces run
    eagerly here, as above)."""
    import fusedtrain.training.graph_capture as capture_mod

    captured = {}
    monkeypatch.setattr(capture_mod, "GraphChain", _eager_chain(captured))
    cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16)
    module = GPTModule(cfg, OptimConfig(), max_steps=10, cuda_graph=True)
    x = torch.randint(0, 64, (2, 16))
    first = module._train_loss(x, x)
    again = module._train_loss(x, x)
    # One process: the whole loss as one piece, captured once.
    assert captured["captures"] == 1 and len(captured["pieces"]) == 1
    assert isinstance(module._graph[1], capture_mod.GraphedLoss)
    torch.testing.assert_close(first, again)
    torch.testing.assert_close(first, module.model.loss(x, x))
    short = torch.randint(0, 64, (1, 16))
    torch.testing.assert_close(module._train_loss(short, short), module.model.loss(short, short))
    assert captured["captures"] == 1


def test_reduce_overhead_compile_marks_each_step_and_logs_a_copy(monkeypatch):
    """compile="reduce-overhead": the loss is compiled in that mode (Inductor's CUDA graphs;
    on CPU Inductor skips them), every training and validation step first tells Inductor a
    new step begins (so it may reuse the previous replay's buffers), and the logged loss is
    a copy, not the replay buffer that the next step overwrites."""
    modes, marks, logged = [], [], []
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None: modes.append(mode) or fn)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16)
    module = GPTModule(cfg, OptimConfig(), max_steps=10, compile="reduce-overhead")
    monkeypatch.setattr(module, "log", lambda name, value, **kw: logged.append(value))
    x = torch.randint(0, 64, (2, 16))
    loss = module.training_step((x, x), 0)
    module.validation_step((x, x), 0)
    assert modes == ["reduce-overhead"] and len(marks) == 2
    assert logged[0] is not loss and torch.equal(logged[0], loss.detach())
    plain = GPTModule(cfg, OptimConfig(), max_steps=10, compile=True)
    assert modes[-1] is None and not plain._replayed


@pytest.mark.parametrize("threads", [False, True])
def test_backward_runs_with_autograd_threads_as_configured(threads):
    """autograd_threads=false (the default) turns autograd's device worker threads off for
    the backward call only; true leaves PyTorch's default."""
    cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16)
    module = GPTModule(cfg, OptimConfig(), max_steps=10, autograd_threads=threads)
    seen = []
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(torch._C._is_multithreading_enabled()))
    module.backward(y.sum())
    assert seen == [threads]
    assert torch._C._is_multithreading_enabled()  # restored afterwards
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


def _fit_tiny_eager(max_steps: int, callbacks: list, **trainer_kwargs):
    """(trainer, module): a one-layer eager GPT fitted on the CPU for max_steps steps of
    two random windows each."""
    import lightning as L

    cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16,
                    kernels={"mlp": False, "qkv": False, "attention": False,
                             "layernorm": False, "cross_entropy": False, "embedding": False})
    module = GPTModule(cfg, OptimConfig(), max_steps=max_steps)
    tokens = torch.randint(0, 64, (2 * max_steps, 17), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False,
                        enable_checkpointing=False, callbacks=callbacks,
                        enable_model_summary=False, **trainer_kwargs)
    trainer.fit(module, train_dataloaders=data)
    return trainer, module


def test_nothing_is_read_back_from_the_device_for_the_progress_bar_each_step(tmp_path):
    """Lightning turns each metric logged with prog_bar=True into a number at every step's
    end (a read from the GPU that stalls the host there): training logs none, and the bar
    shows host values instead, the loss one step late and the rate with its MFU."""
    from fusedtrain.training.callbacks import ProgressBar, ThroughputMonitor

    throughput = ThroughputMonitor(skip_steps=1, window=2)
    bar = ProgressBar(throughput, refresh_rate=1)
    trainer, module = _fit_tiny_eager(6, [throughput, bar])
    assert trainer.progress_bar_metrics == {}
    shown = bar.get_metrics(trainer, module)
    assert float(shown["loss"]) == pytest.approx(module.last_loss, rel=1e-3)
    assert 0 < module.last_loss < 10
    assert float(shown["tokens/s"]) == pytest.approx(throughput.tokens_per_s, rel=1e-3)
    assert {"train/loss", "tokens_per_s"} <= set(trainer.callback_metrics)  # still logged


def test_a_resumed_run_leaves_its_own_warm_up_steps_out_of_the_rate():
    """Resumed at step 97, the process compiles and tunes again: its first window starts
    `skip_steps` after 97, not at the first step past a multiple of the window."""
    from fusedtrain.training.callbacks import ThroughputMonitor

    monitor = ThroughputMonitor(skip_steps=3, window=5)
    trainer = SimpleNamespace(global_step=97, max_steps=122, accumulate_grad_batches=1,
                              world_size=1)
    logged = []
    module = SimpleNamespace(log=lambda name, value: logged.append((trainer.global_step, name)))
    batch = (torch.zeros(2, 8, dtype=torch.long),)
    monitor.on_train_start(trainer, module)
    for step in range(98, 123):
        trainer.global_step = step
        monitor.on_train_batch_end(trainer, module, None, batch, 0)
    assert [step for step, name in logged if name == "tokens_per_s"] == [105, 110, 115, 120, 122]
    assert monitor.tokens_per_s > 0


@pytest.mark.parametrize("scale", [1e3, 1e-3])  # clipped, and left alone
def test_clip_grad_norm_matches_torch_bit_for_bit(scale):
    from fusedtrain.training.optimizer import clip_grad_norm

    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 16), (16,), (48, 16), (3,), (16, 64)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(a.shape, generator=gen) * scale
        b.grad = a.grad.clone()
    ours[1].grad = None  # parameters without a gradient are skipped
    theirs[1].grad = None
    total = clip_grad_norm(ours, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert torch.equal(total, expected)
    for a, b in zip(ours, theirs):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
    # Mixed dtypes go to torch's own function (one group per dtype).
    mixed = [torch.nn.Parameter(torch.ones(4)),
             torch.nn.Parameter(torch.ones(4, dtype=torch.float64))]
    for p in mixed:
        p.grad = torch.full_like(p, 3.0)
    assert clip_grad_norm(mixed, 1.0).item() == pytest.approx(72 ** 0.5)  # eight 3s
    assert all(torch.allclose(p.grad, torch.full_like(p, 3 / 72 ** 0.5)) for p in mixed)


@pytest.mark.parametrize("scale", [1e3, 1e-3])  # clipped, and left alone
def test_clipping_in_fusedtrain_adamw_steps_as_clipping_first(scale):
    """clip_grad_norm handing its coefficient to fusedtrain's AdamW (multiplied in the
    step's kernel, under the interpreter here) gives the parameters that clipping the
    gradients in place and then stepping gives, bit for bit."""
    from fusedtrain.training.optimizer import clip_grad_norm

    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 16), (16,), (48, 16), (3,)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opts = [AdamW(ps, lr=1e-2, copy_dtype=None) for ps in (ours, theirs)]
    for _ in range(2):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=gen).to(DEVICE) * scale
            b.grad = a.grad.clone()
        unclipped = [a.grad.clone() for a in ours]
        assert torch.equal(clip_grad_norm(ours, 1.0, opts[0]), clip_grad_norm(theirs, 1.0))
        for opt in opts:
            opt.step()
        # The kernel's step read the coefficient: the gradients are left unclipped.
        assert all(torch.equal(a.grad, g) for a, g in zip(ours, unclipped))
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)


def test_the_python_heap_is_frozen_from_the_end_of_the_warm_up_to_the_end_of_training():
    """Python's full collections walk every tracked object (~500k once torch, Lightning
    and the caches are loaded): after the warm-up those objects are frozen out of them."""
    import gc

    import lightning as L

    from fusedtrain.training.callbacks import FreezeHeapAfterWarmup

    class Record(L.Callback):
        def __init__(self):
            self.frozen = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.frozen.append((trainer.global_step, gc.get_freeze_count()))

    record = Record()
    gc.unfreeze()
    try:
        _fit_tiny_eager(5, [FreezeHeapAfterWarmup(after=3), record], enable_progress_bar=False)
        assert [step for step, frozen in record.frozen if frozen == 0] == [1, 2]
        assert all(frozen > 1000 for step, frozen in record.frozen if step >= 3)
        assert gc.get_freeze_count() == 0  # released when training ends
    finally:
        gc.unfreeze()


def test_a_resumed_run_freezes_the_heap_after_its_own_warm_up_steps():
    import gc

    from fusedtrain.training.callbacks import FreezeHeapAfterWarmup

    freeze = FreezeHeapAfterWarmup(after=3)
    trainer = SimpleNamespace(global_step=100)
    freeze.on_train_start(trainer, None)
    gc.unfreeze()
    try:
        counts = []
        for step in range(101, 106):
            trainer.global_step = step
            freeze.on_train_batch_end(trainer, None, None, None, 0)
            counts.append(gc.get_freeze_count() > 0)
        assert counts == [False, False, True, True, True]
        freeze.on_exception(trainer, None, KeyboardInterrupt())
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
