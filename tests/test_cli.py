import csv
import os
import subprocess
import sys

import pytest
from conftest import ROOT


def _train(tmp_path, *overrides, timeout=900):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), f"hydra.run.dir={tmp_path}",
           f"data.cache_dir={tmp_path / 'cache'}", "data.max_files=20", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                          env=env)


def _losses(run_dir):
    with open(run_dir / "metrics.csv") as f:
        return [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]


def test_eager_training_end_to_end(tmp_path):
    r = _train(tmp_path, "fused=false", "trainer.max_steps=40", "trainer.val_check_interval=20",
               "trainer.log_every_n_steps=5")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "done: 40 steps" in r.stdout
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    losses = _losses(tmp_path)
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_fused_training_end_to_end(tmp_path):
    r = _train(tmp_path, "fused=true", "trainer.max_steps=4", "trainer.val_check_interval=4",
               "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1")
    assert r.returncode == 0, r.stderr[-3000:]
    components = "mlp, qkv, attention, layernorm, cross_entropy, embedding"
    assert f"fused components: {components}" in r.stderr + r.stdout
    assert "interpreter" in r.stderr + r.stdout  # the one log line naming the CPU fallback
    assert (tmp_path / "metrics.csv").is_file()


@pytest.mark.slow
def test_llama_tiny_trains_fused_and_packed(tmp_path):
    r = _train(tmp_path, "model=llama-tiny", "fused=true", "data.pack=true",
               "trainer.max_steps=3", "trainer.val_check_interval=3",
               "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "done: 3 steps" in r.stdout


@pytest.mark.parametrize("override,setting", [
    ("optim.lr=0", "optim.lr"), ("model.n_head=5", "model.n_head"),
    ("data.batch_size=-2", "data.batch_size"),
    ("trainer=fsdp", "fsdp"),
    ("trainer.devices=0", "trainer.devices"),
    ("data=text", "data.files"),
    ("data.tokenizer=gpt2", "data.bpe_file"),
])
def test_config_errors_exit_nonzero_naming_the_setting(tmp_path, override, setting):
    r = _train(tmp_path, override, timeout=120)
    assert r.returncode != 0
    assert setting in r.stderr
