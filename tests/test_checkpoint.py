import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import ROOT

from fusedtrain.model import GPT, KERNEL_FAMILIES, GPTConfig
from fusedtrain.training.checkpoint import (
    CheckpointError,
    load_checkpoint,
    model_state_from_checkpoint,
    save_checkpoint,
)

TRAIN = [sys.executable, str(ROOT / "scripts" / "train.py")]


def _run(args, tmp_path, timeout=600, prefix=None):
    cmd = (prefix or TRAIN) + [f"data.cache_dir={tmp_path / 'cache'}", "data.max_files=20",
                               "fused=false", *args]
    # MKL_CBWR: MKL's matmuls give the same bits whatever their buffers' alignment, which a
    # resumed run's differ in (a resume once ended 1 ulp off the uninterrupted run's loss).
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "MKL_CBWR": "COMPATIBLE"})


def _final_loss(run_dir):
    import csv

    with open(run_dir / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/loss")]
    return rows[-1]["step"], float(rows[-1]["train/loss"])


def _patched_train(patch: str) -> list[str]:
    """A train.py run with a fault injected by `patch` (Python run before the script)."""
    return [sys.executable, "-c", textwrap.dedent(patch) + textwrap.dedent(f"""
        import runpy, sys
        sys.argv = [{str(ROOT / 'scripts' / 'train.py')!r}] + sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
    """)]


def killed_at(step: int) -> list[str]:
    """A train.py run that SIGKILLs itself at the end of the training step `step`."""
    return _patched_train(f"""
        import os, signal
        from fusedtrain.training.lightning_module import GPTModule
        def die(self, outputs, batch, batch_idx):
            if self.global_step >= {step}:
                os.kill(os.getpid(), signal.SIGKILL)
        GPTModule.on_train_batch_end = die
    """)


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_malicious_pickle_is_refused_without_side_effect(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.ckpt"
    with open(path, "wb") as f:
        pickle.dump({"state_dict": _Evil(str(marker))}, f)
    with pytest.raises(CheckpointError, match="refused"):
        load_checkpoint(path)
    assert not marker.exists()
    # The same payload inside a torch.save zip is refused as well.
    torch.save({"state_dict": _Evil(str(marker))}, tmp_path / "evil2.ckpt")
    marker.unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match="refused"):
        load_checkpoint(tmp_path / "evil2.ckpt")
    assert not marker.exists()


def test_truncated_and_bit_flipped_are_reported(tmp_path):
    path = tmp_path / "a.ckpt"
    save_checkpoint({"w": torch.randn(1000), "step": 3}, path)
    assert load_checkpoint(path)["step"] == 3
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        load_checkpoint(path)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="a.ckpt"):
        load_checkpoint(path)
    (tmp_path / "a.ckpt.sha256").unlink()  # without the sidecar: still a clear error
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(path)


def test_train_export_and_load_fused_or_eager(tmp_path):
    r = _run(["trainer.max_steps=6", "trainer.val_check_interval=3",
              f"hydra.run.dir={tmp_path}"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    raw = load_checkpoint(ckpt)
    assert all(k.startswith("model.") and "_orig_mod" not in k for k in raw["state_dict"])
    out = tmp_path / "model.safetensors"
    e = subprocess.run([sys.executable, str(ROOT / "scripts" / "export.py"), f"ckpt={ckpt}",
                        f"out={out}"], capture_output=True, text=True, timeout=120)
    assert e.returncode == 0, e.stderr
    state, cfg = model_state_from_checkpoint(raw)
    x = torch.randint(0, 256, (2, 16))
    for kernels in (dict.fromkeys(KERNEL_FAMILIES, False), dict.fromkeys(KERNEL_FAMILIES, True)):
        original = GPT(GPTConfig(**{**cfg, "kernels": kernels}))
        original.load_state_dict(state)
        loaded = GPT.from_pretrained(str(out), kernels=kernels)
        with torch.no_grad():
            assert torch.equal(loaded(x), original(x))  # identical logits, fused or eager
    for k, v in GPT.from_pretrained(str(out)).state_dict().items():
        assert torch.equal(v, state[k]), k


def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path):
    common = ["trainer.max_steps=30", "trainer.val_check_interval=5",
              "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    assert _run(common + [f"hydra.run.dir={full}"], tmp_path).returncode == 0
    # Kill the second run with SIGKILL right after step 17 (checkpoint of step 15 on disk).
    r = _run(common + [f"hydra.run.dir={killed}"], tmp_path, prefix=killed_at(17))
    assert r.returncode == -9, r.stderr[-2000:]
    r = _run(common + [f"hydra.run.dir={killed}", "ckpt_path=last"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "done: 30 steps" in r.stdout
    assert _final_loss(killed) == _final_loss(full)


def test_bad_checkpoint_path_is_named(tmp_path):
    r = _run([f"hydra.run.dir={tmp_path}", f"ckpt_path={tmp_path / 'nope.ckpt'}"], tmp_path,
             timeout=120)
    assert r.returncode != 0
    assert "nope.ckpt" in r.stderr


def test_resuming_another_model_shape_is_refused_by_name(tmp_path):
    r = _run([f"hydra.run.dir={tmp_path}", "trainer.max_steps=2",
              "trainer.val_check_interval=2", "trainer.limit_val_batches=1"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    r = _run([f"hydra.run.dir={tmp_path}", "ckpt_path=last", "model.n_layer=3",
              "trainer.max_steps=4"], tmp_path, timeout=120)
    assert r.returncode == 2
    assert "model.n_layer=2 there, 3 here" in r.stderr


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_signal_saves_a_checkpoint_and_exits(tmp_path, sig):
    # Ctrl-C's SIGINT as at a terminal: a job a shell starts in the background (pytest
    # under `nohup ... &`) inherits SIGINT ignored, and Python then keeps it ignored.
    patch = f"""
        import os, signal
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from fusedtrain.training.lightning_module import GPTModule
        def term(self, outputs, batch, batch_idx):
            if self.global_step == 8:
                os.kill(os.getpid(), signal.{sig})
        GPTModule.on_train_batch_end = term
    """
    r = _run(["trainer.max_steps=1000", "trainer.val_check_interval=5",
              "trainer.limit_val_batches=1", f"hydra.run.dir={tmp_path}"], tmp_path,
             prefix=_patched_train(patch))
    assert "interrupted at step" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    ckpt = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] >= 8


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    patch = """
        import torch
        from fusedtrain.model import GPT
        real_loss = GPT.loss
        calls = [0]
        def loss(self, idx, targets):
            calls[0] += 1
            out = real_loss(self, idx, targets)
            return out * float("nan") if self.training and calls[0] > 12 else out
        GPT.loss = loss
    """
    r = _run(["trainer.max_steps=100", "trainer.val_check_interval=5",
              "trainer.limit_val_batches=1", f"hydra.run.dir={tmp_path}"], tmp_path,
             prefix=_patched_train(patch))
    assert r.returncode == 3, r.stderr[-2000:]
    assert "non-finite training loss" in r.stderr and "at step" in r.stderr
    ckpt = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 10  # the last checkpoint before the bad step


def test_non_finite_last_step_writes_no_checkpoint(tmp_path):
    """The loss is checked one step late (no host-device sync a step); a non-finite loss
    in the very last step must still fail the run before the final checkpoint is written."""
    patch = """
        from fusedtrain.model import GPT
        real_loss = GPT.loss
        calls = [0]
        def loss(self, idx, targets):
            calls[0] += self.training
            out = real_loss(self, idx, targets)
            return out * float("nan") if self.training and calls[0] == 6 else out
        GPT.loss = loss
    """
    r = _run(["trainer.max_steps=6", "trainer.val_check_interval=6",
              "trainer.limit_val_batches=1", f"hydra.run.dir={tmp_path}"], tmp_path,
             prefix=_patched_train(patch))
    assert r.returncode == 3, r.stderr[-2000:]
    assert "non-finite training loss at step 5" in r.stderr
    assert not list((tmp_path / "checkpoints").glob("*.ckpt"))


def test_compiled_module_keeps_one_copy_of_the_parameters():
    from fusedtrain.model import GPTConfig
    from fusedtrain.training.lightning_module import GPTModule
    from fusedtrain.training.optimizer import OptimConfig

    cfg = GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=8)
    plain = GPTModule(cfg, OptimConfig(), max_steps=1).state_dict().keys()
    compiled = GPTModule(cfg, OptimConfig(), max_steps=1, compile=True).state_dict().keys()
    assert list(compiled) == list(plain)
    assert all(k.startswith("model.") for k in plain)
