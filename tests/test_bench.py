import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT

BENCH = [sys.executable, str(ROOT / "scripts" / "bench.py")]


def test_train_benchmark_runs_on_the_tiny_model(tmp_path):
    r = subprocess.run(BENCH + ["train", "--model", "tiny", "--batch", "2", "--seq", "16",
                                "--steps", "2", "--warmup", "1", "--variants", "eager-math",
                                "fused", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads((tmp_path / "train.json").read_text())["results"]
    assert set(results) == {"eager-math", "fused"}
    assert all(v["tokens_per_s"] > 0 for v in results.values())
    for v in results.values():  # every timed step's time; the median is theirs
        assert len(v["step_ms"]) == 2 and min(v["step_ms"]) > 0
        assert v["step_ms_median"] == pytest.approx(torch.tensor(v["step_ms"]).median().item())
    assert results["fused"]["speedup_vs"]["eager-math"] > 0
    by_median = results["fused"]["speedup_vs_by_median_step"]["eager-math"]
    assert by_median == pytest.approx(results["eager-math"]["step_ms_median"]
                                      / results["fused"]["step_ms_median"])
    summary = r.stdout[r.stdout.index("speedup vs eager-math"):]  # the table at the end
    assert re.search(rf"fused .* {results['fused']['speedup_vs']['eager-math']:.3f} "
                     rf"\({by_median:.3f}\)", summary)
    assert (tmp_path / "train.png").stat().st_size > 0
    assert all("host_cpu_self" in v for v in results.values())
    assert results["fused"]["host_cpu_self"] > 0.5  # the interpreter: host work throughout
    assert all(v["host_python_ns"] > 0 for v in results.values())
    assert re.search(r"MHz +CPUs +py ns  speedup vs", r.stdout)


def test_loss_parity_on_the_tiny_model(tmp_path):
    r = subprocess.run(BENCH + ["parity", "--batch", "2", "--seq", "16", "--steps", "4",
                                "--data", "synthetic", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((tmp_path / "parity.json").read_text())
    assert result["reference"] == "eager-fp32" and result["seed"] == 0
    assert result["env"] == {"device": "cpu", "model": "tiny", "batch": 2, "seq": 16,
                             "steps": 4, "data": "synthetic", "seed": 0}
    assert list(result["curves"]) == ["eager-fp32", "eager-sdpa", "fused", "eager-math"]
    assert all(len(c) == 4 for c in result["curves"].values())
    diffs = result["max_abs_diff_vs_reference"]
    assert set(diffs) == {"eager-sdpa", "fused", "eager-math"}
    assert max(diffs.values()) < 1e-4  # fp32 on CPU: same math, different kernels
    assert result["fused_vs_eager"] < 1e-4
    assert result["yardsticks"] == ["eager-sdpa", "eager-math"]
    assert result["bf16_noise"] == max(diffs["eager-sdpa"], diffs["eager-math"])
    assert result["within_bf16_noise"] == {"fused": True}
    assert "bf16 noise" in r.stdout
    assert (tmp_path / "parity.png").stat().st_size > 0


def test_parity_verdict_measures_fused_runs_by_eager_bf16s_distance_to_fp32():
    from fusedtrain.bench.parity import PARITY_ATOL, parity_variants, parity_verdict

    v = parity_variants()
    fp32, eager = [3.0, 2.5, 2.0], [3.0, 2.6, 2.05]  # eager bf16 strays 0.1 from fp32
    near, far = [3.0, 2.45, 2.1], [3.0, 2.5, 2.0 + 0.2 + PARITY_ATOL + 1e-6]
    names = ("eager-fp32", "eager-sdpa", "fused", "compile-fused")
    verdict = parity_verdict(dict(zip(names, (fp32, eager, near, far))),
                             {n: v[n] for n in names})
    assert verdict["bf16_noise"] == pytest.approx(0.1)
    assert verdict["within_bf16_noise"] == {"fused": True, "compile-fused": False}
    # Against a bf16 reference, or with no unfused bf16 run, there is nothing to measure by.
    assert parity_verdict({"eager-sdpa": eager, "fused": near},
                          {n: v[n] for n in ("eager-sdpa", "fused")}) == {}
    assert parity_verdict({"eager-fp32": fp32, "fused": near},
                          {n: v[n] for n in ("eager-fp32", "fused")}) == {}


def test_parity_trains_the_variants_asked_for_against_the_first(tmp_path):
    r = subprocess.run(BENCH + ["parity", "--batch", "2", "--seq", "16", "--steps", "3",
                                "--data", "synthetic", "--variants", "eager-fp32",
                                "fused-no-mlp", "eager-sdpa", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((tmp_path / "parity.json").read_text())
    assert result["reference"] == "eager-fp32" and list(result["curves"]) == [
        "eager-fp32", "fused-no-mlp", "eager-sdpa"]
    assert set(result["max_abs_diff_vs_reference"]) == {"fused-no-mlp", "eager-sdpa"}
    assert max(result["max_abs_diff_vs_reference"].values()) < 1e-4  # CPU: fp32 throughout
    assert "fused_vs_eager" not in result  # only where both ran
    for bad in (["eager-sdpa", "fused-graph"], ["eager-sdpa", "eager-sdpa"], ["fused"]):
        r = subprocess.run(BENCH + ["parity", "--variants", *bad, "--out", str(tmp_path / "bad")],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 2 and str(bad) in r.stderr and not (tmp_path / "bad").exists()


def test_gradients_against_the_fp32_model_at_a_point_of_the_parity_run(tmp_path):
    r = subprocess.run(BENCH + ["gradients", "--batch", "2", "--seq", "16", "--at", "2",
                                "--batches", "2", "--data", "synthetic",
                                "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((tmp_path / "gradients.json").read_text())
    assert result["env"] == {"device": "cpu", "model": "tiny", "batch": 2, "seq": 16, "at": 2,
                             "batches": 2, "data": "synthetic", "seed": 0}
    assert result["batches"] == [2, 3] and set(result["loss"]) == {
        "eager-fp32", "eager-sdpa", "eager-math", "fused"}
    err = result["rel_err"]
    groups = set(err["fused"])
    assert "transformer.h.*.mlp.c_fc.weight" in groups and len(groups) == 16
    # On the CPU nothing runs in bf16: eager-sdpa is the fp32 model itself, bit for bit,
    # and the fused kernels differ from it in the order of their fp32 sums only.
    assert all(e == [0.0, 0.0] for e in err["eager-sdpa"].values())
    assert all(0 < max(e) < 1e-4 for e in err["fused"].values())
    assert "all parameters" in r.stdout
    r = subprocess.run(BENCH + ["gradients", "--variants", "compile-fused", "--out",
                                str(tmp_path / "bad")], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 2 and "['compile-fused']" in r.stderr
    assert not (tmp_path / "bad").exists()


def test_gradients_refuses_what_it_cannot_compare():
    from argparse import Namespace

    from fusedtrain.bench.parity import run_gradients

    ok = dict(model="tiny", batch=2, seq=16, at=1, batches=1, seed=0, data="synthetic",
              variants=None)
    for bad in (["eager-fp32"], ["fused", "fused"], ["fused-graph"], ["nope"]):
        with pytest.raises(ValueError, match=re.escape(str(bad))):
            run_gradients(Namespace(**{**ok, "variants": bad}))
    for at, batches in ((-1, 1), (1, 0)):
        with pytest.raises(ValueError, match="--at >= 0 and --batches >= 1"):
            run_gradients(Namespace(**{**ok, "at": at, "batches": batches}))


def test_the_fp32_reference_runs_without_tf32_and_the_settings_come_back():
    from fusedtrain.bench.parity import _tf32_off

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        with _tf32_off():
            assert not torch.backends.cuda.matmul.allow_tf32
            assert not torch.backends.cudnn.allow_tf32
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_a_variant_over_its_time_limit_is_recorded_and_the_rest_still_run(tmp_path):
    r = subprocess.run(BENCH + ["train", "--model", "tiny", "--batch", "2", "--seq", "16",
                                "--steps", "2", "--warmup", "1", "--variant-timeout", "3",
                                "--variants", "compile-fused", "eager-math",
                                "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600,
                       # A cold compile takes well over 3 s; one from Inductor's on-disk
                       # caches (an earlier run's) may not.
                       env={**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads((tmp_path / "train.json").read_text())["results"]
    assert "variant took longer than 3 s" in results["compile-fused"]["error"]
    assert results["eager-math"]["tokens_per_s"] > 0


def _train_args(variants: list[str], timeout: int):
    import argparse

    return argparse.Namespace(ablation=False, compile_mode="default", data="synthetic",
                              variants=variants, variant_timeout=timeout, model="tiny",
                              batch=2, seq=16, steps=2, warmup=1)


def test_variants_after_a_stopped_one_are_flagged(monkeypatch):
    import time

    from fusedtrain.bench import training

    def bench(model, batch, seq, steps, warmup, variant, *rest):  # fused runs past its limit
        if any(variant["kernels"].values()):
            time.sleep(5)
        return {"tokens_per_s": 1e5, "step_ms_median": 30.0, "step_ms_p10": 29.0,
                "step_ms_p90": 31.0, "peak_mem_GiB": 1.0, "final_loss": 5.25}

    monkeypatch.setattr(training, "bench_train_variant", bench)
    results = training.run_train(_train_args(["eager-sdpa", "fused", "eager-sdpa-graph"], 1))
    assert "variant took longer than 1 s" in results["fused"]["error"]
    assert "after_stopped_variant" not in results["eager-sdpa"]
    assert "after_stopped_variant" not in results["fused"]
    assert results["eager-sdpa-graph"]["tokens_per_s"] == 1e5
    assert results["eager-sdpa-graph"]["after_stopped_variant"] == "fused"
    assert "eager-sdpa-graph: ran after fused was stopped" in training.train_table(results)


def test_a_variant_whose_loss_is_not_finite_gives_no_figure(monkeypatch):
    from fusedtrain.bench import training

    def bench(model, batch, seq, steps, warmup, variant, *rest):  # fused diverges
        return {"tokens_per_s": 1e5, "step_ms_median": 30.0,
                "final_loss": float("nan") if any(variant["kernels"].values()) else 5.25}

    monkeypatch.setattr(training, "bench_train_variant", bench)
    results = training.run_train(_train_args(["fused", "eager-sdpa"], 0))
    assert "final loss nan" in results["fused"]["error"]
    assert results["fused"]["discarded"]["tokens_per_s"] == 1e5
    assert results["eager-sdpa"]["tokens_per_s"] == 1e5
    assert "after_stopped_variant" not in results["eager-sdpa"]



def test_graph_captured_variants_run_after_every_plain_one():
    """Plain variants timed after a CUDA-graph capture in the same process ran up to 2.4x
    slower on an H200 than in a fresh one: the captured variants go last."""
    from fusedtrain.bench.training import train_variants

    for ablation in (False, True):
        variants = train_variants(ablation)
        captured = [n for n, v in variants.items() if v.get("graph")]
        assert captured and list(variants)[-len(captured):] == captured


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures on the GPU")
def test_bench_host_without_a_gpu_says_so():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "host",
                        "--calls", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "needs a CUDA GPU" in r.stderr


def test_bench_host_names_only_the_unknown_ops(monkeypatch, tmp_path, capsys):
    """`--ops` with known names runs them; an unknown name is refused, and named alone. A
    run stopped midway has written the rows it measured."""
    import importlib.util

    from fusedtrain.bench import host

    spec = importlib.util.spec_from_file_location("bench_script", ROOT / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(host, "op_cases", lambda B, T: dict.fromkeys(["layer_norm", "linear"]))
    ran = []

    def run_host(shapes, op_names, calls, save):
        ran.append(op_names)
        save([{"op": "layer_norm", "plain_us": 1.0}])
        raise KeyboardInterrupt  # stop before anything needs a GPU

    monkeypatch.setattr(host, "run_host", run_host)
    monkeypatch.setattr(bench, "run_info", lambda *a: {})
    with pytest.raises(KeyboardInterrupt):
        bench.main(["host", "--ops", "layer_norm", "linear", "--out", str(tmp_path)])
    assert ran == [["layer_norm", "linear"]]
    assert json.loads((tmp_path / "host.json").read_text())["rows"] == [
        {"op": "layer_norm", "plain_us": 1.0}]
    assert bench.main(["host", "--ops", "layer_norm", "bogus"]) == 2
    assert "unknown ops ['bogus']" in capsys.readouterr().err


def test_host_table_and_chart_pair_each_op_with_its_twin(tmp_path):
    """bench.py host's summary: per op and shape the fused and eager plain-loop times,
    their ratio, the Python Function's ratio (replay off), the ratio with the backward on
    one thread and of that call's forward and backward halves, the kernels per call; the
    chart is written."""
    from fusedtrain.bench import host

    rows = [{"op": "layer_norm", "shape": s, "variant": v, "plain_us": us, "plain_st_us": st,
             "forward_us": fwd, "gpu_us": g, "kernels": k}
            for s, v, us, st, fwd, g, k in (("tiny", "fused", 90.0, 60.0, 15.0, 11.0, 3),
                                            ("tiny", "python", 240.0, 80.0, 30.0, 11.0, 3),
                                            ("tiny", "eager", 120.0, 50.0, 20.0, 9.0, 3),
                                            ("gpt2", "fused", 130.0, 100.0, 0, 48.0, 3),
                                            ("gpt2", "eager", 170.0, 150.0, 0, 90.0, 3))]
    for row in rows[3:]:  # rows measured before the forward alone was
        del row["forward_us"]
    rows[0]["python_backwards"] = 0
    table = host.host_table(rows).splitlines()
    assert len(table) == 3
    # forward 15 / 20, backward (60 - 15) / (50 - 20)
    assert table[1].split()[:9] == ["layer_norm", "tiny", "90.0", "120.0", "0.75", "2.00",
                                    "1.20", "0.75", "1.50"]
    assert table[2].split()[5] == "nan"  # no python row at that shape
    assert table[2].split()[7:9] == ["nan", "nan"]
    assert [line.split()[-1] for line in table[1:]] == ["0", "-"]
    host.plot_host(rows, tmp_path / "host.png", "title")
    assert (tmp_path / "host.png").stat().st_size > 0


@pytest.mark.parametrize("flags", [[], ["--bias-sums"]])
def test_compile_report_compiles_the_attention_configs_for_hopper_without_a_gpu(tmp_path, flags):
    """scripts/compile_report.py: every dq config of the autotuner (with and without the
    QKV bias gradient's sums), compiled for sm_90 by triton's CUDA backend on this (CPU)
    machine, with its registers, stack and shared memory read back from the cubin."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_report.py"),
                        "--head-dim", "64", "--kernels", "dq", *flags], capture_output=True,
                       text=True, timeout=600,
                       env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = re.findall(r"dq +BLOCK_M +(\d+) BLOCK_N +(\d+) warps +(\d+) stages (\d): +(\d+) "
                      r"registers, +(\d+) B stack, +(\d+) KiB shared", r.stdout)
    from fusedtrain.kernels.attention import BWD_Q_CONFIGS

    assert [tuple(map(int, row[:4])) for row in rows] == [
        (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
        for c in BWD_Q_CONFIGS]
    for *_, registers, _stack, shared in rows:
        assert 0 < int(registers) <= 255 and 0 < int(shared) <= 228


def test_every_triton_kernel_survives_inductors_re_emission(tmp_path):
    """scripts/compile_report.py --inductor-sources: torch.compile writes a user kernel's
    source and its helpers' into its generated code by their names (how a kernel registered
    through torch.library.triton_op runs there); every global a re-emitted kernel reads is
    defined in that source (a helper bound to another name is not; 19 kernels failed so)."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_report.py"),
                        "--inductor-sources"], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert r.stdout.count(": ok") >= 20 and "undefined" not in r.stdout


def test_compile_report_compiles_the_tma_gemms_for_hopper_without_a_gpu(tmp_path):
    """scripts/compile_report.py: the Linear+GELU/MLP and QKV persistent TMA GEMMs at their
    table's tiles, with the epilogues the gpt2 step runs (the QKV forward storing a head at
    a time), and the embedding kernels, compiled for sm_90. (Two device calls were once
    lost to kernels the interpreter ran and the GPU's Triton would not compile; this
    catches such kernels.)"""
    gemms = ["linear_gelu_fwd", "dgelu", "gelu_rhs", "qkv_fwd", "qkv_dx", "qkv_dw", "emb_fwd",
             "emb_bwd"]
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_report.py"),
                        "--head-dim", "64", "--kernels", *gemms], capture_output=True,
                       text=True, timeout=600,
                       env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = re.findall(r"^(\w+) +BLOCK_[MT] +\d+ BLOCK_[NC] +\d+ warps +\d+ stages \d: +(\d+) "
                      r"registers, +(\d+) B stack, +(\d+) KiB shared", r.stdout, re.M)
    assert [row[0] for row in rows] == gemms
    for name, registers, _stack, shared in rows:
        assert 0 < int(registers) <= 255 and (name.startswith("emb") or 0 < int(shared) <= 228)


def test_compile_report_compiles_the_gluon_gemms_with_their_triton_only(tmp_path):
    """scripts/compile_report.py on the Gluon kernels: compiled for sm_90 with the triton
    release they are written for (the warp-specialised GEMMs' registers within the launch's
    cap of 168, 12 warps: 4 + 4 + 1 in whole warpgroups; the one-pass cross-entropy's
    launch shapes, a row of its vocabulary in shared memory without spills: two CTAs per SM
    at GPT-2's, one where a row needs more than half an SM),
    reported as skipped with any other."""
    import triton

    from fusedtrain.kernels._tma import GLUON_TRITON

    names = ["linear_gelu_fwd_ws", "dgelu_ws", "qkv_fwd_ws", "ce_smem"]
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_report.py"),
                        "--kernels", *names], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    if not triton.__version__.startswith(GLUON_TRITON):
        assert re.findall(r"^(\w+): skipped", r.stdout, re.M) == names
        return
    rows = re.findall(r"^(\w+) +BLOCK_M +128 BLOCK_N +128 warps +12 stages 4: +(\d+) "
                      r"registers, +(\d+) B stack", r.stdout, re.M)
    assert [row[0] for row in rows] == names[:3]
    assert all(int(regs) <= 168 and int(stack) == 0 for _, regs, stack in rows)
    ce = re.findall(r"^ce_smem V +(\d+) BOX +(\d+) x 64 boxes +(\d+) warps +(\d+) CTAs per SM "
                    r"(\d): +(\d+) registers, +0 B stack, +(\d+) KiB shared", r.stdout, re.M)
    assert [row[:5] for row in ce] == [("50304", "64", "13", "8", "2"),
                                       ("100032", "128", "13", "16", "1")], r.stdout
    # Each CTA within its share of the SM's 64K registers and 227 KiB of shared memory.
    for *_, warps, ctas, registers, shared in ce:
        assert int(registers) * int(warps) * 32 * int(ctas) <= 65536
        assert int(shared) * int(ctas) <= 227


def test_kernel_report_renders_the_rows_a_gpu_run_wrote(tmp_path, capsys):
    """The table and chart of `bench.py kernels`, from rows an H200 run saved (the
    benchmarks themselves need a GPU)."""
    from fusedtrain.bench import kernels

    rows = []
    for family in ("attn", "attn-features", "ln", "qkv"):
        path = ROOT / "tests" / "data" / f"kernels-graph-{family}.json"
        rows += json.loads(path.read_text())["rows"]
    kernels.print_table(rows)
    printed = capsys.readouterr().out
    assert printed.count("\n") >= len(rows) and "sdpa_cudnn" in printed and "fwd_GBps" in printed
    assert "peer_kernels: sdpa_default ['cudnn_generated_fort_native_sdpa" in printed
    kernels.plot_kernels(rows, tmp_path / "k.png", "title")
    assert (tmp_path / "k.png").stat().st_size > 0
    assert set(kernels.FAMILIES) == {"linear_gelu", "qkv", "attention", "attention_features",
                                     "attention_varlen", "layernorm", "cross_entropy",
                                     "swiglu", "rope"}


def test_bench_kernels_writes_each_row_as_measured(monkeypatch, tmp_path):
    """A kernels run stopped inside a family has written the rows measured before."""
    import importlib.util

    from fusedtrain.bench import kernels

    spec = importlib.util.spec_from_file_location("bench_script", ROOT / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "env", lambda: {"gpu": "none"})

    def family(rows):
        rows.append({"family": "stub", "shape": "first"})
        raise KeyboardInterrupt  # the second row is never measured

    monkeypatch.setattr(kernels, "FAMILIES", {"stub": family})
    with pytest.raises(KeyboardInterrupt):
        bench.main(["kernels", "--family", "stub", "--graph", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "kernels-graph.json").read_text())
    assert saved["rows"] == [{"family": "stub", "shape": "first"}]


def test_document_lengths_span_the_range_and_fill_the_total():
    from fusedtrain.bench.kernels import document_lengths

    lengths = document_lengths()
    assert len(lengths) == 16 and sum(lengths) == 32768
    assert min(lengths) >= 128 and max(lengths) <= 4096
    assert document_lengths(seed=1) != lengths


def test_the_timed_steps_run_with_the_python_heap_frozen(monkeypatch):
    """A full garbage collection inside the few timed steps would be charged to the
    variant it lands in: the heap is frozen after each variant's warm-up, for its timed
    steps only."""
    import gc

    from fusedtrain.bench import training

    setup, frozen = training.train_setup, []

    def recording_setup(*args, **kwargs):
        model, step, data = setup(*args, **kwargs)

        def recording_step(i):
            frozen.append(gc.get_freeze_count())
            return step(i)

        return model, recording_step, data

    monkeypatch.setattr(training, "train_setup", recording_setup)
    gc.unfreeze()
    training.bench_train_variant("tiny", 2, 16, 3, 2,
                                 training.train_variants(False)["eager-math"], "cpu")
    assert frozen[:2] == [0, 0] and all(n > 1000 for n in frozen[2:]) and len(frozen) == 5
    assert gc.get_freeze_count() == 0


def test_clock_samples_parse_with_and_without_the_power_cap_field():
    from fusedtrain.bench.gpu_clocks import parse_samples

    s = parse_samples(["1755, 652.3, Active", "1980, 301.0, Not Active", "1605, 690.1, Active",
                       "[N/A], [N/A], [N/A]", ""])
    assert s["sm_clock_mhz_median"] == 1755 and s["sm_clock_mhz_min"] == 1605
    assert s["power_w_median"] == pytest.approx(652.3) and s["clock_samples"] == 3
    assert s["power_capped_share"] == pytest.approx(2 / 3)
    assert "power_capped_share" not in parse_samples(["1830, 640"])
    assert parse_samples(['Field "x" is not a valid field to query.']) is None


def test_clock_sampler_falls_back_to_the_fields_an_older_driver_knows(tmp_path, monkeypatch):
    from fusedtrain.bench import gpu_clocks

    fake = tmp_path / "nvidia-smi"  # rejects the newest field, then samples until stopped
    fake.write_text('#!/bin/sh\ncase "$*" in *power.draw.instant*) '
                    'echo "Field is not a valid field to query."; exit 2;; esac\n'
                    'while true; do echo "1740, 655.5"; sleep 0.01; done\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_clocks, "_device_id", lambda device: str(device))
    with gpu_clocks.ClockSampler(device=0) as s:
        time.sleep(0.2)
    assert s.summary["sm_clock_mhz_median"] == 1740 and s.summary["clock_samples"] >= 2
    assert "power_capped_share" not in s.summary
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))  # no nvidia-smi: no figures
    with gpu_clocks.ClockSampler(device=0) as s:
        pass
    assert s.summary is None


def test_clock_sampler_gives_up_on_an_nvidia_smi_that_prints_nothing(tmp_path, monkeypatch):
    from fusedtrain.bench import gpu_clocks

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nexec sleep 100\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_clocks, "_device_id", lambda device: str(device))
    monkeypatch.setattr(gpu_clocks, "_FIRST_SAMPLE_S", 0.2)
    t0 = time.monotonic()
    with gpu_clocks.ClockSampler(device=0) as s:
        pass
    assert s.summary is None and time.monotonic() - t0 < 5


def test_proc_stat_gives_busy_and_stolen_ticks():
    from fusedtrain.bench.host_load import machine_ticks

    text = ("cpu  100 5 20 9000 40 3 2 7 11 0\n"
            "cpu0 50 2 10 4500 20 1 1 3 5 0\nintr 1 2 3\n")
    assert machine_ticks(text) == (100 + 5 + 20 + 3 + 2, 7)  # idle, iowait, steal out
    with pytest.raises(ValueError):
        machine_ticks("intr 1 2 3\n")


def test_host_load_counts_a_busy_thread_as_one_core(monkeypatch):
    from fusedtrain.bench import host_load

    with host_load.HostLoad() as h:
        t_end = time.perf_counter() + 0.5
        while time.perf_counter() < t_end:  # one thread, busy throughout
            pass
    s = h.summary
    # Loose bounds: a shared CI machine may give the thread less than all of a core.
    assert 0.5 < s["host_cpu_self"] < 1.5 and s["host_cpus"] == os.cpu_count()
    assert s["host_cpu_all"] > 0.5 and 0 <= s["host_cpu_steal"] < s["host_cpus"]
    with host_load.HostLoad() as h:
        time.sleep(0.3)  # waiting costs no CPU
    assert h.summary["host_cpu_self"] < 0.2
    monkeypatch.setattr(host_load, "_PROC_STAT", Path("/nonexistent"))
    with host_load.HostLoad() as h:  # no /proc/stat: the process's own figure only
        pass
    assert set(h.summary) == {"host_cpu_self", "host_cpus"}


def test_python_speed_grows_with_the_work_an_iteration_does(monkeypatch):
    from fusedtrain.bench import host_load

    plain = host_load.python_speed_ns(2000, 3)
    monkeypatch.setattr(host_load, "_probe_call", lambda a, key=0: sum(range(300)))
    assert host_load.python_speed_ns(2000, 3) > 3 * plain > 0


def test_interleaved_blocks_alternate_the_runs_and_take_each_median(monkeypatch):
    """bench.py host times an op's fused and eager loops in alternating blocks (the host's
    speed can change between them), each figure the median of its blocks."""
    from fusedtrain.bench import host

    order, speeds = [], {"a": iter([5.0, 1.0, 3.0, 9.0]), "b": iter([2.0, 4.0, 6.0, 8.0])}

    def plain_loop_us(run, calls):
        order.append((run(), calls))
        return next(speeds[order[-1][0]])

    monkeypatch.setattr(host, "plain_loop_us", plain_loop_us)
    got = host._interleaved_us({"a": lambda: "a", "b": lambda: "b"}, 40, blocks=4)
    assert order == [("a", 10), ("b", 10), ("b", 10), ("a", 10),
                     ("a", 10), ("b", 10), ("b", 10), ("a", 10)]
    assert got == {"a": 5.0, "b": 6.0}


def test_packed_variant_trains_on_the_windows_documents():
    """bench.py train --data stdlib: the packed variants train the same windows with their
    documents (targets across a boundary ignored), here the eager one on the CPU; without
    documents (synthetic data) they are not offered."""
    from fusedtrain.bench import training

    assert "fused-packed" not in training.train_variants(False)
    variant = training.train_variants(False, documents=True)["eager-sdpa-packed"]
    model, step, data = training.train_setup("tiny", 2, 64, 2, variant, "cpu", "stdlib")
    assert torch.isfinite(step(0))
    batch = torch.tensor([[5, 0, 7, 8, 0], [1, 2, 0, 0, 3]])  # byte 0 ends a document
    targets, cu = training._documents(batch)
    assert targets.tolist() == [[0, -100, 8, 0], [2, 0, -100, -100]]
    assert cu.tolist() == [0, 2, 4, 7, 8]


def test_no_chart_where_no_variant_gave_a_figure(tmp_path):
    from fusedtrain.bench import training

    assert not training.plot_train({"fused": {"error": "stopped"}}, tmp_path / "t.png", "t")
    assert not (tmp_path / "t.png").exists()
