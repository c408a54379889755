"""Compile the attention kernels' autotune configs, the persistent TMA GEMMs (the
Linear+GELU/MLP and QKV kernels) at their table's tiles, the SwiGLU GEMMs at their
autotune candidates and their TMA versions at their tiles, the QKV forward's pointer
kernel at its autotune candidates, the rotary kernel and the embedding kernels (as
gpt_embedding runs them for packed rows: token and position ids, fp32 tables; and the
table sweep and per-id rows of an embedding's bf16 gradient), for a
Hopper GPU (sm_90) on a machine without one, and print what each costs in registers,
stack (register spills) and shared memory per config: a look at register pressure, and a
check that the GPU's Triton compiles them at all, before spending device time.

Triton's CUDA backend compiles without a GPU (its bundled ptxas), and the bundled
cuobjdump reads the resources of the result. Arguments are specialised as at a benchmark
shape (pointers 16-byte aligned, the head dimension's strides 1, other sizes and strides
multiples of 16). The compiler is this machine's triton, which may differ from the GPU
machine's (put that version first on PYTHONPATH, e.g. `pip install --no-deps --target DIR
triton==3.6.0`): the figures guide, the GPU decides.

  python scripts/compile_report.py [--head-dim 128] [--softcap] [--grouped] [--varlen]
      [--bias-sums] [--rope]
      [--kernels fwd dkdv dq linear_gelu_fwd dgelu gelu_rhs qkv_fwd qkv_fwd_pointer qkv_dx
                 qkv_dw emb_fwd emb_bwd emb_sweep emb_rows
                 swiglu_act swiglu_bwd rope
                 linear_gelu_fwd_ws dgelu_ws qkv_fwd_ws swiglu_fwd_ws ce_smem]

The last five are Gluon kernels (the warp-specialised GEMMs of kernels.gemm_gluon and the
one-pass cross-entropy of kernels.cross_entropy_smem at GPT-2's vocabulary), written
against the Gluon API of one triton release (_tma.GLUON_TRITON): with another, they are
reported as skipped. `--inductor-sources` checks instead that every Triton kernel survives
torch.compile's re-emission of user kernels (each helper under its own name).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch

# Before fusedtrain is imported: kernels must be defined for the GPU, not the interpreter.
os.environ.pop("TRITON_INTERPRET", None)
torch.cuda.is_available = lambda: True

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fusedtrain.kernels import attention as A  # noqa: E402
from fusedtrain.kernels import attention_bwd as AB  # noqa: E402
from fusedtrain.kernels import embedding as E  # noqa: E402
from fusedtrain.kernels import linear_gelu as LG  # noqa: E402
from fusedtrain.kernels import qkv as Q  # noqa: E402
from fusedtrain.kernels import rope as R  # noqa: E402
from fusedtrain.kernels import swiglu as SW  # noqa: E402
from fusedtrain.kernels._gemm import gemm_configs  # noqa: E402
from fusedtrain.kernels._tma import GLUON_TRITON, tma_config  # noqa: E402
from fusedtrain.kernels.gelu import FAST_TANH  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")

# fp32 buffers: the attention's statistics, partial sums, the stream-K dW2 sum (STREAM_K).
FP32_POINTERS = ("lse_ptr", "delta_ptr", "part_ptr", "c_ptr")


def argument_type(name: str, pointers: dict[str, str]) -> str:
    """A kernel argument's type as at a bf16 benchmark shape: pointers to bf16 data (fp32
    for FP32_POINTERS; the kernel's own `pointers` first), fp32 softmax scales, i32 sizes
    and strides."""
    if name in pointers:
        return pointers[name]
    if name in ("cu_q_ptr", "cu_k_ptr"):  # a packed batch's cu_seqlens
        return "*i32"
    if name.endswith("_ptr"):
        return "*fp32" if name in FP32_POINTERS else "*bf16"
    return "fp32" if name in ("qk_scale", "sm_scale", "cap_in", "cap_out") else "i32"


def _tma_tiles(config) -> triton.Config:
    """A TmaConfig as the triton.Config it launches with."""
    meta = config.meta()
    warps, stages = meta.pop("num_warps"), meta.pop("num_stages")
    return triton.Config(meta, num_warps=warps, num_stages=stages)


def _table_config() -> triton.Config:
    """The TMA GEMMs' tiles from their measured table (tma_config), at a 3072-wide output."""
    return _tma_tiles(tma_config(3072))


# The embedding kernels' one tile, and their pointers: int64 ids, fp32 tables and gradients.
_EMB_CONFIG = [triton.Config({"BLOCK_T": E._BLOCK_T, "BLOCK_C": E._BLOCK_C},
                             num_warps=E._WARPS)]
_EMB_POINTERS = {"idx_ptr": "*i64", "pid_ptr": "*i64", **dict.fromkeys(
    ["w_ptr", "pos_ptr", "x_ptr", "dy_ptr", "dw_ptr", "dpos_ptr"], "*fp32")}

# The embedding's gradient for up to SWEEP_TOKENS tokens (bf16, one sweep of the table) and
# for more (the per-id fp32 sums of bf16 rows, the pass that adds them).
_SWEEP_CONFIG = [triton.Config({"BLOCK_R": E._SWEEP_ROWS, "BLOCK_M": E._SWEEP_BLOCK,
                                "BLOCK_C": E._BLOCK_C}, num_warps=4)]
_SWEEP_POINTERS = {"idx_ptr": "*i64"}
_ROWS_CONFIG = [triton.Config({"BLOCK_T": E._BLOCK_T, "BLOCK_C": E._BLOCK_C, "WRITE": False},
                              num_warps=E._WARPS)]
_ROWS_POINTERS = {"idx_ptr": "*i64", "first_ptr": "*i32", "dst_ptr": "*fp32"}

# The SwiGLU elementwise passes' one tile.
_PASS_CONFIG = [triton.Config({"BLOCK_M": SW._PASS_TILE[0], "BLOCK_N": SW._PASS_TILE[1]},
                              num_warps=8)]

# Rotary embeddings' pointers: int64 positions, fp32 frequencies.
_ROPE_POINTERS = {"pos_ptr": "*i64", "freq_ptr": "*fp32"}

# name -> (kernel, configs, pointer types that differ from argument_type's default)
# (the attention's: the candidates of head dims up to 128, then those past it; see
# attention_configs)
KERNELS = {"fwd": (A._attn_fwd_kernel, (A.FWD_CONFIGS, A.FWD_HEAD_256), {}),
           "dkdv": (AB._attn_bwd_dkdv_kernel, (A.BWD_KV_CONFIGS, A.BWD_KV_HEAD_256), {}),
           "dq": (AB._attn_bwd_dq_kernel, (A.BWD_Q_CONFIGS, A.BWD_Q_HEAD_256), {}),
           "linear_gelu_fwd": (LG._linear_gelu_fwd_tma_kernel, [_table_config()], {}),
           "dgelu": (LG._matmul_dgelu_tma_kernel, [_table_config()], {}),
           "gelu_rhs": (LG._matmul_gelu_rhs_tma_kernel, [_table_config()], {}),
           "qkv_fwd": (Q._qkv_fwd_tma_kernel, [_table_config()], _ROPE_POINTERS),
           "qkv_fwd_pointer": (Q._qkv_fwd_kernel, gemm_configs(), _ROPE_POINTERS),
           "qkv_dx": (Q._qkv_dx_tma_kernel, [_table_config()], {}),
           "qkv_dw": (Q._qkv_dw_tma_kernel, [_table_config()], {}),
           "emb_fwd": (E._embedding_fwd_kernel, _EMB_CONFIG, _EMB_POINTERS),
           "emb_bwd": (E._embedding_bwd_kernel, _EMB_CONFIG, _EMB_POINTERS),
           "emb_sweep": (E._table_sweep_kernel, _SWEEP_CONFIG, _SWEEP_POINTERS),
           "emb_rows": (E._rows_kernel, _ROWS_CONFIG, _ROWS_POINTERS),
           "swiglu_act": (SW._swiglu_act_kernel, _PASS_CONFIG, {}),
           "swiglu_bwd": (SW._swiglu_bwd_kernel, _PASS_CONFIG, {}),
           "rope": (R._rope_kernel, [triton.Config({"BLOCK_T": R._BLOCK_T, "BLOCK_D": 64})],
                    _ROPE_POINTERS)}


# Gluon kernels (name -> (module in fusedtrain.kernels, kernel, pointer types)), as the gpt2
# step runs them: bias, h stored, tanh GELU, column sums; int64 targets and fp32 losses.
WS_KERNELS = {"linear_gelu_fwd_ws": ("linear_gelu_gluon", "_linear_gelu_fwd_ws_kernel", {}),
              "dgelu_ws": ("linear_gelu_gluon", "_matmul_dgelu_ws_kernel", {}),
              "qkv_fwd_ws": ("qkv_gluon", "_qkv_fwd_ws_kernel", _ROPE_POINTERS),
              "swiglu_fwd_ws": ("swiglu_gluon", "_swiglu_fwd_ws_kernel", {}),
              "ce_smem": ("cross_entropy_smem", "_ce_smem_kernel",
                          {"target_ptr": "*i64", "count_ptr": "*i64", "loss_ptr": "*fp32"})}


def jit_function(kernel) -> triton.runtime.jit.JITFunction:
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn  # through the autotuner
    return kernel


def _specialised(fn, constexprs: dict, pointers: dict[str, str] | None = None):
    """(constexprs, signature, attributes) of fn as launched at a benchmark shape."""
    # Names the kernel does not take (unit strides of tensors it has no pointer to)
    # are left out.
    unit_strides = {f"s_{t}d": 1 for t in "qkvogd"}
    consts = {n: v for n, v in {**unit_strides, **constexprs}.items() if n in fn.arg_names}
    signature = {n: "constexpr" if n in consts else argument_type(n, pointers or {})
                 for n in fn.arg_names}
    # What triton's launcher tells the compiler at a benchmark shape: the unit strides of
    # the head dimension are the constant 1, every pointer is 16-byte aligned and every
    # other integer (sizes, strides) a multiple of 16. Without it, loads would compile to
    # one element per instruction.
    divisible = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if signature[n] != "constexpr" and (signature[n].startswith("*")
                                                     or signature[n] == "i32")}
    return consts, signature, divisible


def compile_config(kernel, config: triton.Config, constexprs: dict,
                   pointers: dict[str, str] | None = None):
    fn = jit_function(kernel)
    consts, signature, divisible = _specialised(fn, {**constexprs, **config.kwargs}, pointers)
    source = ASTSource(fn, signature=signature, constexprs=consts, attrs=divisible)
    return triton.compile(source, target=HOPPER, options={"num_warps": config.num_warps,
                                                          "num_stages": config.num_stages})


# The one-pass cross-entropy's vocabularies: GPT-2's (two CTAs per SM) and one whose bf16
# rows only one CTA's shared memory holds.
CE_VOCABS = (50304, 100032)


def ce_shape(vocab: int):
    """cross_entropy_smem's launch shape for bf16 rows of `vocab` logits."""
    from fusedtrain.kernels import cross_entropy_smem

    return cross_entropy_smem.launch_shape(torch.empty(0, vocab, dtype=torch.bfloat16))


def compile_ws(name: str, constexprs: dict, vocab: int = CE_VOCABS[0]):
    """A Gluon kernel of WS_KERNELS, compiled as launched (kernels.gemm_gluon.launch, or
    cross_entropy_smem's launch shape for rows of `vocab` logits)."""
    import importlib

    from triton.experimental.gluon._runtime import GluonASTSource

    from fusedtrain.kernels import gemm_gluon

    module, kernel, pointers = WS_KERNELS[name]
    fn = jit_function(getattr(importlib.import_module(f"fusedtrain.kernels.{module}"), kernel))
    options = {"num_warps": 4, "maxnreg": gemm_gluon._MAXNREG}
    if module == "cross_entropy_smem":
        shape = ce_shape(vocab)
        constexprs = {**constexprs, "NB": shape.boxes(vocab), "BOX": shape.box,
                      "WARPS": shape.warps}
        options = {"num_warps": shape.warps, "maxnreg": shape.maxnreg}
    consts, signature, divisible = _specialised(fn, constexprs, pointers)
    source = GluonASTSource(fn, signature=signature, constexprs=consts, attrs=divisible)
    return triton.compile(source, target=HOPPER, options=options)


def resources(compiled) -> dict[str, int]:
    """Registers per thread, stack bytes per thread (spills) and shared memory bytes."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    if found is None:
        raise RuntimeError(f"no resource line in cuobjdump's output:\n{out}")
    return {"registers": int(found[1]), "stack_bytes": int(found[2]),
            "shared_bytes": compiled.metadata.shared}


# The Triton (not Gluon) kernel modules, whose kernels torch.library.triton_op could hand
# to Inductor.
TRITON_MODULES = ("adamw", "attention", "attention_bwd", "bias_grad", "cross_entropy",
                  "embedding", "layernorm", "linear_gelu", "qkv", "rope", "swiglu")


def inductor_undefined(kernel: triton.runtime.jit.JITFunction) -> list[str]:
    """The globals that Inductor's re-emitted source of a user kernel (with its helpers, as
    torch.compile writes a kernel registered through torch.library.triton_op into its
    generated code) reads without defining; an alias of a helper under another name is
    one."""
    import dis
    import importlib.util

    from torch._inductor.codegen.wrapper import (
        user_defined_triton_kernel_transitive_closure_source_code as emitted,
    )

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"emitted_{kernel.__name__}.py")
        with open(path, "w") as f:
            f.write("import triton\nimport triton.language as tl\n" + emitted(kernel))
        spec = importlib.util.spec_from_file_location(f"emitted_{kernel.__name__}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    names = vars(module)
    return sorted({i.argval for fn in names.values()
                   if isinstance(fn, triton.runtime.jit.JITFunction)
                   for i in dis.Bytecode(fn.fn) if i.opname == "LOAD_GLOBAL"}
                  - set(names) - set(dir(__builtins__)))


def report_inductor_sources() -> bool:
    """Prints, for every Triton kernel, the names inductor_undefined finds; True if none."""
    import importlib

    clean = True
    for name in TRITON_MODULES:
        module = importlib.import_module(f"fusedtrain.kernels.{name}")
        for attr in sorted(vars(module)):
            if not attr.endswith("_kernel"):
                continue
            kernel = jit_function(getattr(module, attr))
            if kernel.fn.__module__ != module.__name__:
                continue
            missing = inductor_undefined(kernel)
            clean &= not missing
            print(f"{name}.{attr}: {'undefined ' + ', '.join(missing) if missing else 'ok'}")
    return clean


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head-dim", type=int, default=128,
                   help="the attention's BLOCK_D (16, 32, 64, 128 or 256), and the QKV forward's D")
    p.add_argument("--softcap", action="store_true", help="the attention's softcapped scores")
    p.add_argument("--grouped", action="store_true",
                   help="the attention's grouped key/value heads (the dk/dv kernel's loop)")
    p.add_argument("--varlen", action="store_true", help="the attention over a packed batch")
    p.add_argument("--inductor-sources", action="store_true",
                   help="instead: check that Inductor's re-emitted source of every Triton "
                        "kernel defines all it reads (exit 1 if not)")
    p.add_argument("--kernels", nargs="+", choices=[*KERNELS, *WS_KERNELS],
                   default=[*KERNELS, *WS_KERNELS])
    p.add_argument("--bias-sums", action="store_true",
                   help="the dq kernel also sums the QKV bias gradient (ops.qkv_attention)")
    p.add_argument("--rope", action="store_true",
                   help="the QKV forwards rotate q and k in their epilogues")
    args = p.parse_args(argv)
    if args.inductor_sources:
        sys.exit(0 if report_inductor_sources() else 1)
    # Each kernel takes the ones it names: the attention's, then the GEMMs' epilogues as
    # the fused gpt2 step runs them (bias, h stored, tanh GELU, column sums, stream-K sums
    # added in place, q, k, v stored a head at a time when the head dim allows).
    block_n = _table_config().kwargs["BLOCK_N"]
    constexprs = dict(VARLEN=args.varlen, SOFTCAP=args.softcap, GROUPED=args.grouped,
                      ACC=tl.float32, PRECISION="tf32",
                      BLOCK_D=args.head_dim, TMA=True, BIAS_SUMS=args.bias_sums,
                      GRAIN=A.BIAS_GRAIN, HAS_BIAS=True, STORE_H=True, APPROX=FAST_TANH.value,
                      COL_SUMS=True, STREAM_K=True, POSITIONS=True, POSITION_IDS=True,
                      STORE_GU=True, INVERSE=False, ROPE=args.rope,
                      HEAD_D=args.head_dim if args.head_dim in (block_n // 2, block_n // 4) else 0)
    print(f"triton {triton.__version__}, target sm_90, bf16, head dim {args.head_dim}, "
          f"softcap {args.softcap}, grouped {args.grouped}, varlen {args.varlen}, "
          f"rope {args.rope}")
    for name in args.kernels:
        if name in WS_KERNELS:
            if not triton.__version__.startswith(GLUON_TRITON):
                print(f"{name}: skipped (a Gluon kernel, written for triton {GLUON_TRITON}x)")
                continue
            from fusedtrain.kernels import gemm_gluon

            if name == "ce_smem":
                for vocab in CE_VOCABS:
                    shape = ce_shape(vocab)
                    r = resources(compile_ws(name, constexprs, vocab))
                    print(f"{name} V {vocab:6d} BOX {shape.box:3d} x 64 boxes "
                          f"{shape.boxes(vocab):2d} warps {shape.warps:2d} CTAs per SM "
                          f"{shape.ctas_per_sm}: {r['registers']:3d} registers, "
                          f"{r['stack_bytes']:5d} B stack, {r['shared_bytes'] // 1024:3d} KiB "
                          "shared", flush=True)
                continue
            compiled = compile_ws(name, constexprs)
            r = resources(compiled)
            tile = (f"BLOCK_M {gemm_gluon.BM.value:3d} BLOCK_N {gemm_gluon.BN.value:3d} warps "
                    f"{compiled.metadata.num_warps:2d} stages {gemm_gluon.STAGES.value}")
            print(f"{name:5s} {tile}: {r['registers']:3d} registers, {r['stack_bytes']:5d} B "
                  f"stack, {r['shared_bytes'] // 1024:3d} KiB shared", flush=True)
            continue
        kernel, configs, pointers = KERNELS[name]
        if isinstance(configs, tuple):
            configs = configs[args.head_dim > 128]
        for config in configs:
            tile = " ".join(f"{k} {v:3d}" for k, v in config.kwargs.items()
                            if k in ("BLOCK_M", "BLOCK_N", "BLOCK_T", "BLOCK_C"))
            r = resources(compile_config(kernel, config, constexprs, pointers))
            print(f"{name:5s} {tile} warps {config.num_warps:2d} "
                  f"stages {config.num_stages}: {r['registers']:3d} registers, "
                  f"{r['stack_bytes']:5d} B stack, {r['shared_bytes'] // 1024:3d} KiB shared",
                  flush=True)


if __name__ == "__main__":
    sys.exit(main())
