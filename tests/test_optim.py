"""fusedtrain.optim.AdamW: torch's AdamW, also writing the weights' bf16 copies."""

import pytest
import torch

from fusedtrain import casts
from fusedtrain.optim import AdamW
from fusedtrain.weight_copies import WEIGHT_COPIES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(37,), (130, 72), (9000,), (3, 3000)]  # one spans two chunks under the interpreter


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(DEVICE).requires_grad_() for s in SHAPES]


def _pair(**options):
    """(ours, torch's) over equal parameters in two groups, weight decay on the first."""
    mine, ref = _params(), _params()

    def groups(ps):
        return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]

    return (mine, AdamW(groups(mine), lr=1e-2, **options),
            ref, torch.optim.AdamW(groups(ref), lr=1e-2, foreach=False))


def _step_both(mine, opt, ref, opt_ref, seed):
    g = torch.Generator().manual_seed(seed)
    for p, r in zip(mine, ref):
        grad = torch.randn(p.shape, generator=g).to(DEVICE)
        p.grad, r.grad = grad.clone(), grad.clone()
    opt.step()
    opt_ref.step()


def _close(mine, opt, ref, opt_ref):
    for p, r in zip(mine, ref):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], opt_ref.state[r][key],
                                       rtol=1e-5, atol=1e-7)


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max().item()


def test_steps_as_torch_adamw_and_publishes_the_bf16_weights():
    mine, opt, ref, opt_ref = _pair()
    for seed in range(3):
        _step_both(mine, opt, ref, opt_ref, seed)
    _close(mine, opt, ref, opt_ref)
    assert all(opt.state[p]["step"].item() == 3 for p in mine)
    for p in mine:
        copy = casts._prepared_copy(p, torch.bfloat16)
        assert copy is not None and copy.dtype == torch.bfloat16
        # The GPU rounds to nearest even, as p.to(bfloat16); the interpreter truncates.
        assert _ulps_apart(copy, p.detach().to(torch.bfloat16)) <= (0 if p.is_cuda else 1)
        assert casts._prepared_copy(p, torch.float16) is None  # another dtype: cast anew


def test_a_parameter_changed_after_the_step_is_cast_again():
    mine, opt, ref, opt_ref = _pair()
    _step_both(mine, opt, ref, opt_ref, 0)
    with torch.no_grad():
        mine[0].add_(1.0)  # in place: a new version
        mine[1].data = mine[1].data.clone()  # new storage, same version counter
    assert casts._prepared_copy(mine[0], torch.bfloat16) is None
    assert casts._prepared_copy(mine[1], torch.bfloat16) is None
    assert casts._prepared_copy(mine[2], torch.bfloat16) is not None


def test_checkpoint_round_trip_continues_the_same_trajectory():
    mine, opt, ref, opt_ref = _pair()
    for seed in range(2):
        _step_both(mine, opt, ref, opt_ref, seed)
    state = opt.state_dict()
    resumed = _params()
    with torch.no_grad():
        for p, q in zip(resumed, mine):
            p.copy_(q)
    opt2 = AdamW([{"params": resumed[:2], "weight_decay": 0.1},
                  {"params": resumed[2:], "weight_decay": 0.0}], lr=1e-2)
    opt2.load_state_dict(state)
    _step_both(resumed, opt2, ref, opt_ref, 2)
    _close(resumed, opt2, ref, opt_ref)


def test_options_the_kernel_lacks_step_through_torch_without_copies():
    mine, opt, ref, _ = _pair(amsgrad=True)
    opt_ref = torch.optim.AdamW([{"params": ref[:2], "weight_decay": 0.1},
                                 {"params": ref[2:], "weight_decay": 0.0}], lr=1e-2,
                                foreach=False, amsgrad=True)
    for seed in range(2):
        _step_both(mine, opt, ref, opt_ref, seed)
    for p, r in zip(mine, ref):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)
        assert casts._prepared_copy(p, torch.bfloat16) is None


def test_bad_copy_dtype_is_refused():
    with pytest.raises(ValueError, match="copy_dtype"):
        AdamW(_params(), copy_dtype=torch.int8)


def test_no_copies_when_asked_for_none():
    mine, opt, ref, opt_ref = _pair(copy_dtype=None)
    _step_both(mine, opt, ref, opt_ref, 0)
    _close(mine, opt, ref, opt_ref)
    assert all(casts._prepared_copy(p, torch.bfloat16) is None for p in mine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_captured_steps_replay_as_eager_steps():
    """Steps captured in a CUDA graph (gradients at the graph's addresses, the step count
    on the device) replayed twice equal two eager steps."""
    mine, opt, ref, opt_ref = _pair()
    static = [torch.zeros_like(p) for p in mine]
    _step_both(mine, opt, ref, opt_ref, 0)  # the state exists before the capture
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        for p, s in zip(mine, static):
            p.grad = s * 1.0  # made inside the graph: its own address
        opt.step()
    torch.cuda.current_stream().wait_stream(side)
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        for s, r in zip(static, ref):
            grad = torch.randn(s.shape, generator=g).to(DEVICE)
            s.copy_(grad)
            r.grad = grad.clone()
        graph.replay()
        opt_ref.step()
    torch.cuda.synchronize()
    _close(mine, opt, ref, opt_ref)
    for p in mine:
        assert torch.equal(casts._prepared_copy(p, torch.bfloat16), p.detach().to(torch.bfloat16))


def test_a_published_copy_goes_with_its_parameter():
    mine, opt, ref, opt_ref = _pair()
    _step_both(mine, opt, ref, opt_ref, 0)
    ids = [id(p) for p in mine]
    assert all(i in WEIGHT_COPIES._entries for i in ids)
    del mine, opt, ref, opt_ref
    assert not any(i in WEIGHT_COPIES._entries for i in ids)


def test_a_closure_makes_the_gradients_first():
    """As Lightning steps: the gradients exist only once the closure has run."""
    mine, opt, ref, opt_ref = _pair()
    # Gradients known exactly on every device (a product's rounding would differ by
    # where the GPU reduces it): loss = sum(w * p), the gradient w.
    weights = [torch.randn(s, device=DEVICE) for s in SHAPES]

    def loss_of(params):
        return sum((w * p).sum() for w, p in zip(weights, params))

    for params, optimizer in ((mine, opt), (ref, opt_ref)):
        optimizer.zero_grad(set_to_none=True)

        def closure(params=params):
            loss = loss_of(params)
            loss.backward()
            return loss

        optimizer.step(closure)
    _close(mine, opt, ref, opt_ref)
    assert all(casts._prepared_copy(p, torch.bfloat16) is not None for p in mine)


def test_a_zero_beta_steps_through_torch():
    mine, opt, ref, _ = _pair(betas=(0.0, 0.999))
    opt_ref = torch.optim.AdamW([{"params": ref[:2], "weight_decay": 0.1},
                                 {"params": ref[2:], "weight_decay": 0.0}], lr=1e-2,
                                betas=(0.0, 0.999), foreach=False)
    _step_both(mine, opt, ref, opt_ref, 0)
    for p, r in zip(mine, ref):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("options", [{}, {"amsgrad": True}])  # the kernel; torch's step
def test_a_gradient_scale_applies_to_the_next_step_alone(options):
    """scale_gradients_in_step(s) steps as if every gradient had been multiplied by s
    first (clipping's last operation), bit for bit, and only the next step."""
    mine, scaled = _params(), _params()
    opt = AdamW([{"params": mine, "weight_decay": 0.1}], lr=1e-2, **options)
    opt_scaled = AdamW([{"params": scaled, "weight_decay": 0.1}], lr=1e-2, **options)
    s = torch.tensor(0.37, device=DEVICE)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        grads = [torch.randn(p.shape, generator=g).to(DEVICE) for p in mine]
        for p, q, grad in zip(mine, scaled, grads):
            p.grad = grad.clone()
            q.grad = grad * s if seed == 1 else grad.clone()
        if seed == 1:
            opt.scale_gradients_in_step(s)
        opt.step()
        opt_scaled.step()
        if seed == 1 and not options:  # the kernel reads the scale: .grad left as it was
            assert all(torch.equal(p.grad, grad) for p, grad in zip(mine, grads))
    for p, q in zip(mine, scaled):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt_scaled.state[q]["exp_avg_sq"])


def test_a_bad_gradient_scale_is_refused():
    opt = AdamW(_params(), lr=1e-2)
    with pytest.raises(ValueError, match="0-dim float32"):
        opt.scale_gradients_in_step(torch.ones(2))
    with pytest.raises(ValueError, match="0-dim float32"):
        opt.scale_gradients_in_step(torch.tensor(1.0, dtype=torch.float64))
