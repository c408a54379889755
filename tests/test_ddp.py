import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import ROOT, train_losses


def _train(run_dir, tmp_path, *overrides):
    return train_losses(run_dir, tmp_path, "data.max_files=20", "model.block_size=16",
                        "trainer.max_steps=3", "trainer.val_check_interval=3",
                        "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1",
                        "fused=true", *overrides)


@pytest.mark.slow
@pytest.mark.parametrize("pack", [False, True])
def test_ddp_on_two_cpu_processes_matches_one_process_on_the_global_batch(tmp_path, pack):
    packing = f"data.pack={str(pack).lower()}"
    r, ddp = _train(tmp_path / "ddp", tmp_path, "trainer=ddp", "trainer.accelerator=cpu",
                    "trainer.devices=2", "data.batch_size=2", packing)
    assert "GLOBAL_RANK: 1" in r.stderr + r.stdout  # both ranks ran
    _, single = _train(tmp_path / "single", tmp_path, "data.batch_size=4", packing)
    assert len(ddp) == len(single) == 3
    for a, b in zip(ddp, single):
        assert abs(a - b) < 1e-4, (ddp, single)


@pytest.mark.slow
def test_ddp_resume_with_more_steps_continues_the_sample_stream(tmp_path):
    """Two CPU ranks: 3 steps, then resume from last.ckpt with max_steps=5. Every step
    of the resumed run matches an uninterrupted 5-step run (once, Lightning started a
    new epoch after the resume and the stream restarted at the resume point)."""
    ddp = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "data.batch_size=2",
           "fused=false"]
    _, first = _train(tmp_path / "run", tmp_path, *ddp)
    _, resumed = _train(tmp_path / "run", tmp_path, *ddp, "trainer.max_steps=5",
                        "trainer.val_check_interval=5", "ckpt_path=last")
    _, straight = _train(tmp_path / "straight", tmp_path, *ddp, "trainer.max_steps=5",
                         "trainer.val_check_interval=5")
    assert len(first) == 3 and len(straight) == 5
    assert resumed[-2:] == pytest.approx(straight[-2:], abs=1e-6)


@pytest.mark.slow
def test_non_finite_loss_on_one_rank_stops_every_rank(tmp_path):
    """Rank 0 (the patched launcher process) sees NaN from step 3, rank 1 does not: both
    must stop with the non-finite-loss error instead of rank 1 hanging in a collective."""
    patch = textwrap.dedent("""
        from fusedtrain.model import GPT
        real_loss, calls = GPT.loss, [0]
        def loss(self, idx, targets):
            calls[0] += 1
            out = real_loss(self, idx, targets)
            return out * float("nan") if self.training and calls[0] > 2 else out
        GPT.loss = loss
        import runpy, sys
        sys.argv = [{train!r}] + sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
    """).format(train=str(ROOT / "scripts" / "train.py"))
    cmd = [sys.executable, "-c", patch, f"hydra.run.dir={tmp_path / 'run'}",
           f"data.cache_dir={tmp_path / 'cache'}", "data.max_files=20", "model.block_size=16",
           "trainer.max_steps=20", "trainer.val_check_interval=20",
           "trainer.limit_val_batches=1", "fused=false", "trainer=ddp",
           "trainer.accelerator=cpu", "trainer.devices=2", "data.batch_size=2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 3, r.stderr[-3000:]
    assert r.stderr.count("non-finite training loss at step 2") >= 1


def _gpt2_summary(run_dir, tmp_path, *overrides):
    """A short gpt2 run (B=16 per GPU, T=1024, synthetic tokens): its summary.json."""
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), f"hydra.run.dir={run_dir}",
           "model=gpt2", "data=synthetic", "data.batch_size=16", "trainer.max_steps=40",
           "trainer.val_check_interval=40", "trainer.limit_val_batches=1",
           "throughput_skip_steps=10", "fused=true", *overrides]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    print(f"{run_dir.name}: {summary}")
    return summary


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpu_fsdp_shards_and_trains_like_ddp(tmp_path):
    ddp = _gpt2_summary(tmp_path / "ddp", tmp_path, "trainer=ddp")
    fsdp = _gpt2_summary(tmp_path / "fsdp", tmp_path, "trainer=fsdp")
    assert ddp["devices"] == fsdp["devices"] == 2
    print(f"tokens/s: ddp {ddp['tokens_per_s']:.0f}, fsdp {fsdp['tokens_per_s']:.0f}; MFU: "
          f"{ddp['mfu']:.3f}, {fsdp['mfu']:.3f}; peak GiB per GPU: ddp {ddp['peak_mem_GiB']:.2f}, "
          f"fsdp {fsdp['peak_mem_GiB']:.2f}")
    assert fsdp["peak_mem_GiB"] < ddp["peak_mem_GiB"]
    assert fsdp["train_loss"] == pytest.approx(ddp["train_loss"], abs=2e-2)
    # MFU counts the whole model on every rank, not FSDP's shard of it.
    assert fsdp["mfu"] / fsdp["tokens_per_s"] == pytest.approx(
        ddp["mfu"] / ddp["tokens_per_s"], rel=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpu_ddp_with_graphed_steps(tmp_path):
    """cuda_graph=true under DDP: each rank replays its pieces' graphs, DDP all-reduces a
    block's gradients while earlier blocks' backward graphs replay. It must train like
    plain DDP and scale: DDP's tokens/s over twice one GPU's (both graphed) >= 0.90."""
    single = _gpt2_summary(tmp_path / "single-graph", tmp_path, "trainer=gpu", "cuda_graph=true")
    ddp = _gpt2_summary(tmp_path / "ddp-graph", tmp_path, "trainer=ddp", "cuda_graph=true")
    plain = _gpt2_summary(tmp_path / "ddp-plain", tmp_path, "trainer=ddp")
    efficiency = ddp["tokens_per_s"] / (2 * single["tokens_per_s"])
    print(f"graphed: one GPU {single['tokens_per_s']:.0f}, DDP {ddp['tokens_per_s']:.0f} "
          f"tokens/s (efficiency {efficiency:.3f}); plain DDP {plain['tokens_per_s']:.0f}")
    assert ddp["devices"] == 2
    assert ddp["train_loss"] == pytest.approx(plain["train_loss"], abs=2e-2)
    assert ddp["val_loss"] == pytest.approx(plain["val_loss"], abs=2e-2)
    assert efficiency >= 0.90


def test_fused_ops_refuse_dtensors_by_name():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from fusedtrain import ops

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = distribute_tensor(torch.ones(8), mesh, [Replicate()])
        with pytest.raises(TypeError, match="weight is a DTensor"):
            ops.layer_norm(torch.randn(4, 8), w, None)
    finally:
        dist.destroy_process_group()
