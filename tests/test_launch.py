"""kernels._launch.FastLaunch: the shortcut to a compiled kernel is taken only for a
specialisation and tuning key that triton has launched before, with triton's own
arguments; everything else goes through triton. On the CPU with stand-ins for triton's
JITFunction and Autotuner; on a GPU with the real kernels."""

from types import SimpleNamespace

import pytest
import torch
from triton.runtime.autotuner import Autotuner

from fusedtrain.kernels import _launch


class _Compiled:
    function, packed_metadata = "function", "metadata"
    metadata = SimpleNamespace(global_scratch_size=0)

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


class _Jit:
    """What FastLaunch reads of a JITFunction: its binder (specialising ints by their
    remainder mod 16, as triton's tells 16-divisible ones apart) and its launch."""

    arg_names = ["x_ptr", "n", "BLOCK"]
    pre_run_hooks: list = []

    def __init__(self):
        self.triton_calls = []
        self.compiled = {}
        self.device_caches = {0: (None, None, None, None, self._binder)}

    @staticmethod
    def _binder(x_ptr, n, BLOCK, **options):
        bound = {"x_ptr": x_ptr, "n": n, "BLOCK": BLOCK}
        return bound, [("*fp32", x_ptr % 16 == 0), ("i32", n % 16 == 0), ("constexpr", BLOCK)], \
            options

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.triton_calls.append((grid, args, kwargs))
            _, spec, options = self._binder(*args, **kwargs)
            return self.compiled.setdefault((tuple(spec), tuple(options.items())), _Compiled())
        return launch


@pytest.fixture
def enabled(monkeypatch):
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_current_stream", lambda device: 7)


def test_repeated_specialisation_skips_triton(enabled):
    jit = _Jit()
    kernel = _launch.fast_launch(jit)
    kernel[(4,)](32, 64, BLOCK=128)  # first: through triton
    assert len(jit.triton_calls) == 1
    kernel[lambda meta: (meta["n"] // meta["BLOCK"], 2)](48, 256, BLOCK=128)  # same spec
    assert len(jit.triton_calls) == 1
    (compiled,) = jit.compiled.values()
    assert compiled.launches == [(2, 2, 1, 7, "function", "metadata", None, None, None,
                                  48, 256, 128)]
    kernel[(4,)](32, 65, BLOCK=128)  # n no longer divisible by 16: a new specialisation
    kernel[(4,)](32, 64, BLOCK=64)  # a new constexpr
    kernel[(4,)](32, 64, BLOCK=128, num_warps=8)  # a new option
    assert len(jit.triton_calls) == 4


@pytest.mark.parametrize("blocker", ["disabled", "launch hook", "pre-run hook"])
def test_triton_path_when_shortcut_is_unsafe(enabled, monkeypatch, blocker):
    jit = _Jit()
    kernel = _launch.fast_launch(jit)
    if blocker == "disabled":
        monkeypatch.setattr(_launch, "ENABLED", False)
    elif blocker == "launch hook":
        monkeypatch.setattr(_launch, "_launch_hooks", lambda: True)
    else:
        monkeypatch.setattr(jit, "pre_run_hooks", [print])
    for _ in range(3):
        kernel[(4,)](32, 64, BLOCK=128)
    assert len(jit.triton_calls) == 3


class _Tuner(Autotuner):
    """An Autotuner over a _Jit keyed on n (without Autotuner's constructor, which wants
    a real JITFunction); tuning picks the last config."""

    def __init__(self, jit, configs):
        self.fn, self.configs, self.keys, self.arg_names = jit, configs, ["n"], jit.arg_names
        self.cache = {}

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.cache[(args[1],)] = self.configs[-1]
            return self.fn[grid](*args, **kwargs, **self.configs[-1].all_kwargs())
        return launch


def test_autotuned_kernel_uses_the_tuners_choice(enabled):
    import triton

    jit = _Jit()
    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((64, 4), (128, 8))]
    tuner = _Tuner(jit, configs)
    kernel = _launch.fast_launch(tuner)
    kernel[(4,)](32, 64)  # not tuned yet: through the autotuner
    kernel[(4,)](32, 64)  # tuned, but this specialisation not yet seen by the shortcut
    kernel[(4,)](48, 64)  # shortcut
    assert len(jit.triton_calls) == 2 and tuner.best_config is configs[-1]
    (compiled,) = jit.compiled.values()
    assert compiled.launches[-1][-3:] == (48, 64, 128)
    kernel[(4,)](32, 80)  # another tuning key: the autotuner again
    assert len(jit.triton_calls) == 3


class _TensorJit(_Jit):
    """A _Jit whose first argument is a tensor (specialised on its 16-byte alignment) and
    whose binder calls are counted."""

    arg_names = ["x_ptr", "n", "scale", "BLOCK"]

    def __init__(self):
        super().__init__()
        self.bindings = 0
        self.device_caches = {0: (None, None, None, None, self._count)}

    def _count(self, *args, **kwargs):
        self.bindings += 1
        return self._binder(*args, **kwargs)

    @staticmethod
    def _binder(x_ptr, n, scale, BLOCK, **options):
        bound = {"x_ptr": x_ptr, "n": n, "scale": scale, "BLOCK": BLOCK}
        return bound, [("*fp32", x_ptr.data_ptr() % 16 == 0), ("i32", n % 16 == 0),
                       ("fp32", None), ("constexpr", BLOCK)], options


def test_a_repeated_call_launches_from_its_plan_without_binding(enabled):
    """From the second launch of a specialisation on, a call with the same integers,
    dtypes and keywords (floats aside) skips the binder; a call whose tensor is aligned
    otherwise goes the general way (and gets the kernel its alignment needs)."""
    jit = _TensorJit()
    kernel = _launch.fast_launch(jit)
    buf = torch.zeros(64)
    kernel[(4,)](buf, 64, 0.5, BLOCK=128)  # compiled by triton
    kernel[(4,)](buf, 64, 0.5, BLOCK=128)  # bound, launched, planned
    assert (len(jit.triton_calls), jit.bindings) == (1, 2)
    kernel[(4,)](torch.zeros(64), 64, 0.25, BLOCK=128)  # another lr-like float: the plan
    assert jit.bindings == 2
    (compiled,) = jit.compiled.values()
    assert compiled.launches[-1][-3:-1] == (64, 0.25)
    kernel[(4,)](buf[1:], 64, 0.5, BLOCK=128)  # 4 bytes off: not the plan's alignment
    assert len(jit.triton_calls) == 2  # a new specialisation, compiled by triton
    kernel[(4,)](buf, 80, 0.5, BLOCK=128)  # another integer: another plan
    assert jit.bindings == 4


def test_a_planned_launch_skips_its_arguments_function(enabled, monkeypatch):
    """planned(key, args, launch): launch() (grid and constexprs) is called until the key
    has a plan; with FUSEDTRAIN_CHECK_PLANS a key that misses what the launch depends on
    is caught."""
    jit = _TensorJit()
    kernel = _launch.fast_launch(jit)
    buf, made = torch.zeros(64), []

    def launch(block=128):
        made.append(block)
        return (lambda meta: (meta["n"] // 16,)), {"BLOCK": block}

    for _ in range(4):
        kernel.planned(("n", 64), (buf, 64, 0.5), launch)
    assert len(made) == 2  # compiled, then planned; the last two from the plan
    (compiled,) = jit.compiled.values()
    assert compiled.launches[-1][:3] == (4, 1, 1) and compiled.launches[-1][-1] == 128
    (entry,) = [d for d in _launch.describe() if d["key"] == repr(("n", 64))]
    assert entry["grid"] == (4, 1, 1) and entry["constexprs"] == {"BLOCK": "128"}
    assert entry["why"] == "the family's one Triton kernel"
    monkeypatch.setattr(_launch, "CHECK_PLANS", True)
    kernel.planned(("n", 64), (buf, 64, 0.5), launch)  # the key holds: no error
    with pytest.raises(_launch.PlanMismatchError):  # BLOCK is not in the key
        kernel.planned(("n", 64), (buf, 64, 0.5), lambda: launch(block=64))


def test_planned_without_a_key_is_the_general_path(enabled):
    """planned(None, args, launch) asks launch() every call and launches as
    kernel[grid](*args, **kwargs) does (the call's own signature keys its plan): what a
    launcher given a tuning config takes."""
    jit = _TensorJit()
    kernel = _launch.fast_launch(jit)
    buf, made = torch.zeros(64), []

    def launch():
        made.append(1)
        return (4,), {"BLOCK": 128}

    for _ in range(3):
        kernel.planned(None, (buf, 64, 0.5), launch)
    assert len(made) == 3 and len(jit.triton_calls) == 1
    kernel[(4,)](buf, 64, 0.5, BLOCK=128)  # the plan those calls made
    assert jit.bindings == 2


class _DirectLauncher:
    """Triton 3.6's compiled launcher as a plan sees it: the C `launch` and its flags."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = 0, 1

    def __init__(self):
        self.direct, self.through_call = [], []

    def launch(self, *args):
        self.direct.append(args)

    def __call__(self, *args):
        self.through_call.append(args)


def test_a_plan_calls_the_c_launcher_with_addresses(enabled, monkeypatch):
    """With triton 3.6's launcher layout and no scratch memory, a planned launch passes
    each tensor's address as an int straight to the C launch, its flags before the
    metadata; a misaligned tensor still leaves the plan."""
    monkeypatch.setattr(_launch, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(_launch, "_on_device", lambda t: True)  # the stand-ins are CPU tensors
    jit = _TensorJit()
    kernel = _launch.fast_launch(jit)
    buf = torch.zeros(64)
    kernel[(4,)](buf, 64, 0.5, BLOCK=128)  # compiled by triton
    (compiled,) = jit.compiled.values()
    compiled.run = launcher = _DirectLauncher()
    kernel[(4,)](buf, 64, 0.5, BLOCK=128)  # bound, planned (through the launcher's call)
    other = torch.zeros(64)
    kernel[(4,)](other, 64, 0.25, BLOCK=128)  # from the plan
    assert launcher.direct == [(4, 1, 1, 7, "function", 0, 1, None, None, "metadata", None,
                                None, None, other.data_ptr(), 64, 0.25, 128)]
    assert [d["launch"] for d in _launch.describe() if d["key"].startswith("((torch.float32")]
    kernel[(4,)](buf[1:], 64, 0.5, BLOCK=128)  # 4 bytes off: triton compiles another
    assert len(launcher.direct) == 1 and len(jit.triton_calls) == 2


def test_a_cpu_tensor_goes_through_the_launchers_own_checks(enabled, monkeypatch):
    """A plan made for device tensors hands a call with a CPU tensor (same dtypes and
    integers) to triton's launcher, whose pointer check raises, not to the C launch with a
    host address."""
    monkeypatch.setattr(_launch, "DIRECT_LAUNCH", True)
    jit = _TensorJit()
    kernel = _launch.fast_launch(jit)
    buf = torch.zeros(64)
    kernel[(4,)](buf, 64, 0.5, BLOCK=128)
    (compiled,) = jit.compiled.values()
    compiled.run = launcher = _DirectLauncher()
    kernel[(4,)](buf, 64, 0.5, BLOCK=128)  # planned
    kernel[(4,)](torch.zeros(64), 64, 0.5, BLOCK=128)  # from the plan, a CPU tensor
    assert launcher.direct == [] and len(launcher.through_call) == 2


@pytest.mark.gpu
def test_fast_launch_matches_triton_on_gpu(monkeypatch):
    """LayerNorm's autotuned forward and the bias-gradient column sums (plain jit):
    bit-identical results through the shortcut and through triton, and the repeated
    calls do take the shortcut."""
    from fusedtrain.kernels import bias_grad, layernorm

    x = torch.randn(3000, 768, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(3000, 768, device="cuda")
    w, b = torch.randn(768, device="cuda"), torch.randn(768, device="cuda")

    def both():
        y = layernorm.layer_norm_fwd(x, r, w, b, 1e-5, None, torch.bfloat16, torch.float32)
        return [*y, bias_grad.bias_grad(x, torch.float32)]

    monkeypatch.setattr(_launch, "ENABLED", False)
    reference = both()
    monkeypatch.setattr(_launch, "ENABLED", True)
    both()  # compiled kernels recorded
    calls = []
    for kernel in (layernorm._ln_fwd_kernel, bias_grad._column_sums_kernel):
        monkeypatch.setattr(kernel, "fn", _Spy(kernel.fn, calls))
    for _ in range(2):
        for got, want in zip(both(), reference):
            assert torch.equal(got, want)
    assert calls == []
    planned = {d["kernel"]: d for d in _launch.describe()}
    assert "BLOCK_M" in planned["_ln_fwd_kernel"]["constexprs"]
    if _launch.DIRECT_LAUNCH:  # triton 3.6: the plans called its C launcher themselves
        assert planned["_ln_fwd_kernel"]["launch"] == "C launcher, addresses as ints"
    assert _launch._path("_linear_gelu_fwd_ws_kernel", {}) == _launch.PATHS["_ws_kernel"]


class _Spy:
    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]

