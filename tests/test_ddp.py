import csv
import os
import subprocess
import sys

import pytest
from conftest import ROOT


def _train(run_dir, tmp_path, *overrides):
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), f"hydra.run.dir={run_dir}",
           f"data.cache_dir={tmp_path / 'cache'}", "data.max_files=20", "model.block_size=16",
           "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.limit_val_batches=1",
           "trainer.log_every_n_steps=1", "fused=true", *overrides]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    with open(run_dir / "metrics.csv") as f:
        return r, [float(row["train/loss"]) for row in csv.DictReader(f) if row["train/loss"]]


@pytest.mark.slow
def test_ddp_on_two_cpu_processes_matches_one_process_on_the_global_batch(tmp_path):
    r, ddp = _train(tmp_path / "ddp", tmp_path, "trainer=ddp", "trainer.accelerator=cpu",
                    "trainer.devices=2", "data.batch_size=2")
    assert "GLOBAL_RANK: 1" in r.stderr + r.stdout  # both ranks ran
    _, single = _train(tmp_path / "single", tmp_path, "data.batch_size=4")
    assert len(ddp) == len(single) == 3
    for a, b in zip(ddp, single):
        assert abs(a - b) < 1e-4, (ddp, single)
