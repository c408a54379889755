"""scripts/train.py and scripts/export.py when things go wrong: resuming keeps what was
logged, `last` means this run dir, a corrupted checkpoint is caught without its sidecar,
every bad input exits with the documented code and one line naming it, and train.log
tells the run's story."""

import csv
import subprocess
import sys
import zipfile

import torch
from conftest import ROOT
from test_checkpoint import _patched_train, _run, killed_at

from fusedtrain.training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

SHORT = ["trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
         "trainer.log_every_n_steps=1"]


def _rows(run_dir, column):
    """(step, value) of metrics.csv's rows that hold `column`."""
    with open(run_dir / "metrics.csv") as f:
        return [(int(r["step"]), r[column]) for r in csv.DictReader(f) if r.get(column)]


def test_a_resumed_run_keeps_the_metrics_logged_before_its_checkpoint(tmp_path):
    """Killed at step 7 (checkpoint of step 6 on disk) and resumed in the same run dir:
    metrics.csv holds every step's training loss once, the same as an uninterrupted run's,
    and the crashed run's rows after the checkpoint are gone."""
    common = ["trainer.max_steps=10", "trainer.val_check_interval=3",
              "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    assert _run(common + [f"hydra.run.dir={full}"], tmp_path).returncode == 0
    r = _run(common + [f"hydra.run.dir={killed}"], tmp_path, prefix=killed_at(8))
    assert r.returncode == -9
    r = _run(common + [f"hydra.run.dir={killed}", "ckpt_path=last"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    steps = [s for s, _ in _rows(killed, "train/loss")]
    assert steps == sorted(set(steps))  # no step twice
    assert _rows(killed, "train/loss") == _rows(full, "train/loss")
    assert _rows(killed, "val/loss") == _rows(full, "val/loss")
    log = (killed / "train.log").read_text()
    assert "resuming from" in log and "at step 6" in log


def test_last_means_this_run_dir_and_latest_names_the_run_it_resumes(tmp_path):
    """ckpt_path=last in a run dir without a checkpoint exits 2 naming the dir, though an
    older run under outputs/ has one; ckpt_path=latest resumes that one and says so."""
    older = tmp_path / "outputs" / "older"
    assert _run(SHORT + [f"hydra.run.dir={older}"], tmp_path).returncode == 0
    fresh = tmp_path / "outputs" / "fresh"
    r = _run(["trainer.max_steps=6", f"hydra.run.dir={fresh}", "ckpt_path=last"], tmp_path,
             timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "ckpt_path=last" in r.stderr and str(fresh) in r.stderr
    assert "Traceback" not in r.stderr
    r = _run(["trainer.max_steps=6", "trainer.limit_val_batches=1", f"hydra.run.dir={fresh}",
              "ckpt_path=latest"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resuming the run in {older.relative_to(tmp_path)}" in r.stdout + r.stderr
    assert "done: 6 steps" in r.stdout


def _flip_a_data_byte(path):
    """Flip one byte inside the first tensor's data member of a torch.save archive."""
    with zipfile.ZipFile(path) as archive:
        member = next(i for i in archive.infolist() if "/data/" in i.filename)
    raw = bytearray(path.read_bytes())
    local = member.header_offset  # the local header's own name and extra-field lengths
    name_len, extra_len = (int.from_bytes(raw[local + i:local + i + 2], "little")
                           for i in (26, 28))
    raw[local + 30 + name_len + extra_len + 7] ^= 0x10
    path.write_bytes(bytes(raw))
    return member.filename


def test_a_flipped_byte_is_caught_without_the_sidecar(tmp_path):
    path = tmp_path / "a.ckpt"
    save_checkpoint({"w": torch.randn(256), "step": 3}, path)
    (tmp_path / "a.ckpt.sha256").unlink()
    assert load_checkpoint(path)["step"] == 3  # intact: loads, with a warning
    member = _flip_a_data_byte(path)
    try:
        load_checkpoint(path)
    except CheckpointError as e:
        assert str(path) in str(e) and member in str(e)
    else:
        raise AssertionError("a corrupted checkpoint without sidecar loaded")


def test_train_refuses_a_corrupted_checkpoint_without_sidecar_and_warns_once(tmp_path):
    assert _run(SHORT + [f"hydra.run.dir={tmp_path}"], tmp_path).returncode == 0
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    for p in (tmp_path / "checkpoints").glob("*.sha256"):
        p.unlink()
    r = _run(["trainer.max_steps=6", "trainer.limit_val_batches=1",
              f"hydra.run.dir={tmp_path}", f"ckpt_path={ckpt}"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (r.stdout + r.stderr).count("has no last.ckpt.sha256 sidecar") == 1
    for p in (tmp_path / "checkpoints").glob("*.sha256"):  # written again by that run
        p.unlink()
    member = _flip_a_data_byte(ckpt)
    r = _run(["trainer.max_steps=6", f"hydra.run.dir={tmp_path}", f"ckpt_path={ckpt}"],
             tmp_path, timeout=120)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "last.ckpt" in r.stderr and member in r.stderr


def test_a_hydra_override_error_exits_2_in_one_line(tmp_path):
    r = _run(["model.n_layrs=3"], tmp_path, timeout=120)
    assert r.returncode == 2
    errors = [line for line in r.stderr.splitlines() if line.startswith("config error")]
    assert len(errors) == 1 and "model.n_layrs" in errors[0]
    assert "Traceback" not in r.stderr


def test_a_corpus_too_small_exits_2_before_training(tmp_path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("nineteen bytes here")
    r = _run(["data=text", f"data.files=[{corpus}]", f"hydra.run.dir={tmp_path / 'run'}"],
             tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "model.block_size" in r.stderr and "tiny.txt" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "run" / "metrics.csv").exists()


def test_tensorboard_without_the_package_exits_2_up_front(tmp_path):
    no_tensorboard = _patched_train("""
        import importlib.util
        real = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *a: (
            None if name.split(".")[0] in ("tensorboard", "tensorboardX") else real(name, *a))
    """)
    r = _run(["tensorboard=true", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path,
             prefix=no_tensorboard, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "tensorboard" in r.stderr and "Traceback" not in r.stderr


def test_export_into_a_missing_directory_names_the_users_path(tmp_path):
    out = tmp_path / "nowhere" / "model.safetensors"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "export.py"),
                        f"ckpt={tmp_path / 'any.ckpt'}", f"out={out}"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert str(out) in r.stderr and ".tmp" not in r.stderr


def test_a_binary_file_is_refused_as_a_corpus_unless_allowed(tmp_path):
    program = tmp_path / "program.bin"
    program.write_bytes(bytes(range(256)) * 400)  # NUL bytes, mostly undecodable
    args = ["data=text", f"data.files=[{program}]", "model.block_size=32", *SHORT]
    r = _run(args + [f"hydra.run.dir={tmp_path / 'a'}"], tmp_path, timeout=120)
    assert r.returncode == 4, r.stderr[-2000:]
    assert "program.bin" in r.stderr and "not text" in r.stderr
    r = _run(args + [f"hydra.run.dir={tmp_path / 'b'}", "data.allow_binary=true"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]


def test_train_log_has_progress_lines_and_the_summary_and_checkpoints_every_n_steps(tmp_path):
    """A line per log interval (step, loss, tokens/s) and the summary in train.log; with
    checkpoint.every_n_steps=2 a kill at step 5 (no validation yet) leaves step 4's."""
    r = _run(["trainer.max_steps=6", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=2",
              f"hydra.run.dir={tmp_path / 'a'}"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    log = (tmp_path / "a" / "train.log").read_text()
    assert "step 2: loss" in log and "step 4: loss" in log and "tokens/s" in log
    assert "done: 6 steps" in log
    r = _run(["trainer.max_steps=20", "trainer.val_check_interval=100",
              "checkpoint.every_n_steps=2", f"hydra.run.dir={tmp_path / 'b'}"], tmp_path,
             prefix=killed_at(5))
    assert r.returncode == -9
    assert load_checkpoint(tmp_path / "b" / "checkpoints" / "last.ckpt")["global_step"] == 4


def test_the_readme_gives_the_cpu_wheel_command_and_a_tensorboard_extra():
    readme = (ROOT / "README.md").read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "\ntb = [" in pyproject and "tensorboard" in pyproject
