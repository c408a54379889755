"""data.pack=true: windows carrying their documents, the model reading them (positions,
attention and the loss restart at each document), fused and eager alike."""


import numpy as np
import pytest
import torch
from conftest import ROOT, train_losses
from hydra import compose, initialize_config_dir

from fusedtrain.config import ConfigError, build_run_config
from fusedtrain.data import IGNORE_INDEX, DataConfig, PackedWindows, pack_collate
from fusedtrain.documents import documents
from fusedtrain.model import GPT, KERNEL_FAMILIES, GPTConfig

EOT = 0


def _windows(seq_len: int = 12) -> PackedWindows:
    rng = np.random.default_rng(3)
    tokens = rng.integers(1, 50, size=400).astype(np.uint16)
    tokens[rng.choice(400, size=60, replace=False)] = EOT  # documents of 1 token and more
    return PackedWindows(tokens, seq_len, seed=5, length=64, eot=EOT)


def test_windows_mark_document_starts_and_ignore_the_targets_across_them():
    windows = _windows()
    for i in range(64):
        x, y, starts = windows[i]
        assert starts[0]
        assert (starts[1:] == (x[:-1] == EOT)).all()
        assert ((y == IGNORE_INDEX) == (x == EOT)).all()  # the next document's first token
        kept = y != IGNORE_INDEX
        assert (y[:-1][kept[:-1]] == x[1:][kept[:-1]]).all()  # the rest: the next token


def test_collate_gives_cu_seqlens_over_the_flattened_rows():
    windows = _windows()
    samples = [windows[i] for i in range(4)]
    x, y, cu = pack_collate(samples)
    assert x.shape == y.shape == (4, 12) and cu.dtype == torch.int32
    starts = torch.cat([s[2] for s in samples])
    assert cu.tolist() == [*torch.nonzero(starts).flatten().tolist(), 48]
    assert set(range(0, 48, 12)) <= set(cu.tolist())  # no document crosses a row


def test_documents_positions_and_mask_restart_at_documents_and_rows():
    B, T, window = 2, 8, 2
    cu = torch.tensor([0, 3, 3, 11, 14, 99], dtype=torch.int32)  # 8 missing; 99 clamped to 16
    docs = documents(cu, B, T, window)
    assert docs.cu_seqlens.tolist() == [0, 0, 3, 3, 8, 11, 14, 16, 16, *[16] * 7]
    for extra in range(8):  # 0..7 more documents: one length of cu_seqlens
        more = torch.cat([cu, torch.full((extra,), 5, dtype=torch.int32)])
        assert documents(more, B, T).cu_seqlens.shape == (16,)
    assert docs.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 0, 1, 2, 0, 1]]
    start = torch.tensor([[0, 0, 0, 3, 3, 3, 3, 3], [0, 0, 0, 3, 3, 3, 6, 6]])
    expected = torch.zeros(B, 1, T, T, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            for j in range(T):
                expected[b, 0, i, j] = start[b, i] <= j <= i and i - j <= window
    assert torch.equal(docs.seen, expected)
    assert documents(cu, B, T, eager=False).seen is None
    with pytest.raises(TypeError, match="int32"):
        documents(cu.long(), B, T)


def test_documents_cu_seqlens_are_read_by_no_attention_op(monkeypatch):
    """documents' cu_seqlens is valid by construction: flash_attention_varlen reads none
    of its values (no device-to-host wait a step), until it is written; a copy of it is
    read, and a bad one still refused."""
    from fusedtrain import ops
    from fusedtrain.ops import attention

    reads = []
    breaks = attention._breaks_rules
    monkeypatch.setattr(attention, "_breaks_rules", lambda *a: reads.append(1) or breaks(*a))
    B, T = 2, 8
    cu = documents(torch.tensor([0, 3, 11], dtype=torch.int32), B, T, eager=False).cu_seqlens
    q = torch.randn(B * T, 2, 4, dtype=torch.float64)
    ops.flash_attention_varlen(q, q, q, cu, cu, T, T)
    assert reads == []
    ops.flash_attention_varlen(q, q, q, cu.clone(), cu.clone(), T, T)
    assert len(reads) == 2
    cu[-1] = 3  # written: checked again, and refused
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        ops.flash_attention_varlen(q, q, q, cu, cu, T, T)


LLAMA = dict(n_kv_head=2, bias=False, norm="rmsnorm", mlp="swiglu", mlp_hidden=48, pos="rope",
             tie_head=False)


def _model(fused: bool, **kw) -> GPT:
    cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32,
                    kernels=dict.fromkeys(KERNEL_FAMILIES, fused), **kw)
    return GPT(cfg).double()


@pytest.mark.parametrize("fused,kw", [
    (False, {}),
    (False, dict(n_kv_head=2, attention_window=3, eager_attention="sdpa")),
    (True, {}),
    (True, dict(n_kv_head=1, attention_window=3)),
    (True, dict(LLAMA, n_kv_head=4)),  # rotary positions restart too
    (False, LLAMA),
])
def test_packed_rows_give_each_document_its_own_logits(fused, kw):
    """A packed batch's logits equal those of each document run alone (fp64)."""
    model = _model(fused, **kw)
    B, T = 2, 16
    idx = torch.randint(0, 64, (B, T))
    cu = torch.tensor([0, 5, 6, 9, 20, 32], dtype=torch.int32)  # row 1's start added
    logits = model(idx, cu)
    bounds = [0, 5, 6, 9, 16, 20, 32]
    for start, end in zip(bounds[:-1], bounds[1:]):
        row, first = divmod(start, T)
        alone = model(idx[row:row + 1, first:end - row * T])[0]
        torch.testing.assert_close(logits[row, first:end - row * T], alone)


def test_packed_loss_and_gradients_fused_equal_eager():
    torch.manual_seed(1)
    eager_model = _model(False, n_kv_head=2)
    fused_model = _model(True, n_kv_head=2)
    fused_model.load_state_dict(eager_model.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    targets = torch.randint(0, 64, (2, 16))
    targets[0, 4] = targets[1, 0] = IGNORE_INDEX
    cu = torch.tensor([0, 5, 16, 27, 32], dtype=torch.int32)
    losses = []
    for model in (eager_model, fused_model):
        loss = model.loss(idx, targets, cu)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0])
    for (name, p), q in zip(eager_model.named_parameters(), fused_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_compiled_packed_loss_follows_the_document_count():
    """torch.compile of the fused packed loss: batches with other numbers of documents
    (cu_seqlens of other lengths) give the uncompiled loss."""
    model = _model(True)
    compiled = torch.compile(model.loss, backend="aot_eager")
    idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    for cu in ([0, 5, 16, 20, 32], [0, 3, 32], [0, 1, 2, 16, 18, 19, 32]):
        cu = torch.tensor(cu, dtype=torch.int32)
        torch.testing.assert_close(compiled(idx, targets, cu), model.loss(idx, targets, cu))


def test_pack_settings_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="data.pack"):
        DataConfig(source="synthetic", pack=True)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["data.pack=true", "cuda_graph=true"])
    with pytest.raises(ConfigError, match="data.pack"):
        build_run_config(cfg)


def _train(run_dir, tmp_path, *overrides) -> list[float]:
    r, losses = train_losses(run_dir, tmp_path, "data.max_files=40", "model.block_size=64",
                             "data.pack=true", "fused=false", "trainer.val_check_interval=3",
                             "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1",
                             *overrides)
    assert "data.pack=true: rows of 64 tokens" in r.stderr + r.stdout
    return losses


@pytest.mark.slow
def test_packed_training_resumes_where_it_stopped(tmp_path):
    """scripts/train.py data.pack=true: 3 steps, then resumed to 6, matching 6 straight."""
    first = _train(tmp_path / "run", tmp_path, "trainer.max_steps=3")
    resumed = _train(tmp_path / "run", tmp_path, "trainer.max_steps=6", "ckpt_path=last")
    straight = _train(tmp_path / "straight", tmp_path, "trainer.max_steps=6")
    assert len(first) == 3 and len(straight) == 6
    assert resumed[-3:] == pytest.approx(straight[-3:], abs=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, dict(LLAMA, n_kv_head=4)])
def test_gpu_packed_rows_give_each_document_its_own_logits(kw):
    """The fused model on the GPU in fp32 (TF32 off): a packed batch's logits equal each
    document run alone, as on the CPU interpreter."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model(True, **kw).float().cuda()
    idx = torch.randint(0, 64, (2, 16), device="cuda")
    cu = torch.tensor([0, 5, 6, 9, 20, 32], dtype=torch.int32, device="cuda")
    logits = model(idx, cu)
    bounds = [0, 5, 6, 9, 16, 20, 32]
    for start, end in zip(bounds[:-1], bounds[1:]):
        row, first = divmod(start, 16)
        alone = model(idx[row:row + 1, first:end - row * 16])[0]
        torch.testing.assert_close(logits[row, first:end - row * 16], alone, rtol=1e-4,
                                   atol=1e-4)
