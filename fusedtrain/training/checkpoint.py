"""Safe checkpoints: one loader that never runs code (torch.load(weights_only=True)),
atomic writes with a SHA-256 sidecar, and safetensors weight export.

A training checkpoint is something people download and share; a pickle that executes
code on load is the classic hole. Every checkpoint load in the project goes through
`load_checkpoint`, Lightning's included (through `SafeCheckpointIO`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

log = logging.getLogger("fusedtrain")


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupted, truncated or holds disallowed objects."""


def sha256_of(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _atomic_write(path: Path, write) -> None:
    """write(f) into a temporary file beside path, fsync, then rename over path."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_checkpoint(obj: dict, path: str | Path) -> None:
    """torch.save atomically (a kill mid-save leaves the previous file intact), then the
    SHA-256 sidecar, also atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, lambda f: torch.save(obj, f))
    digest = sha256_of(path)
    _atomic_write(_sidecar(path), lambda f: f.write(f"{digest}  {path.name}\n".encode()))


_WARNED: set[Path] = set()  # checkpoints already warned about (a run loads one twice)


def _check_members(path: Path) -> None:
    """Every member of a torch.save zip archive against the CRC-32 the archive stores for
    it (torch writes one per member): a flipped byte anywhere in the data is caught before
    anything is unpickled. Raises CheckpointError naming the file and the member."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is unreadable (truncated or corrupted): {e}") from e
    except zipfile.error as e:  # a header that testzip cannot even read
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupted: {e}") from e
    if bad is not None:
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupted: member {bad!r} does "
                              "not match its CRC-32")


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> dict:
    """Verify the content hash (the SHA-256 sidecar, or without one each archive member's
    CRC-32), then torch.load(weights_only=True): tensors, containers and primitives only,
    no code runs. Raises CheckpointError naming the file (and member) otherwise."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {str(path)!r}")
    sidecar = _sidecar(path)
    if sidecar.is_file():
        expected = sidecar.read_text().split()[0]
        if sha256_of(path) != expected:
            raise CheckpointError(
                f"checkpoint {str(path)!r} is corrupted or truncated: its SHA-256 does not "
                f"match {sidecar.name}")
    else:
        # torch.save's zip archive stores a CRC-32 per member; a legacy (non-zip) file has
        # none, and only the safe unpickling below stands between it and the run.
        archive = zipfile.is_zipfile(path)
        if archive:
            _check_members(path)
        if path.resolve() not in _WARNED:
            _WARNED.add(path.resolve())
            log.warning("checkpoint %s has no %s sidecar: %s", path, sidecar.name,
                        "checked against the CRC-32 of each of its archive's members instead"
                        if archive else "not a zip archive either, so loaded unchecked")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"checkpoint {str(path)!r} was refused: it holds objects other than tensors and "
            f"plain data, which could run code on load ({first})") from e
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is unreadable (truncated or corrupted): {e}") from e


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint I/O through the atomic writer and the safe loader."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        save_checkpoint(checkpoint, path)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        return load_checkpoint(path, map_location or "cpu")

    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        _sidecar(Path(path)).unlink(missing_ok=True)


def model_state_from_checkpoint(ckpt: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(GPT state_dict, model config dict) from a Lightning checkpoint of GPTModule,
    with any torch.compile `_orig_mod.` prefix removed."""
    try:
        cfg = ckpt["hyper_parameters"]["model"]
        state = ckpt["state_dict"]
    except KeyError as e:
        raise CheckpointError(f"not a fusedtrain training checkpoint: missing {e}") from e
    out = {}
    for k, v in state.items():
        k = k.removeprefix("model.").replace("_orig_mod.", "")
        if k.startswith("_step_model."):
            continue  # the compiled wrapper's view of the same parameters
        out[k] = v
    return out, cfg


def export_safetensors(state: dict[str, torch.Tensor], config: dict, out: str | Path) -> None:
    """Weights and the model config (as metadata) in a safetensors file."""
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in state.items()}
    out = Path(out)
    _atomic_write(out, lambda f: f.write(b""))  # fail early on an unwritable path
    save_file(tensors, str(out), metadata={"fusedtrain_config": json.dumps(config)})


def load_safetensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file, safe_open

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no weights file at {str(path)!r}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"weights file {str(path)!r} is unreadable: {e}") from e
    if "fusedtrain_config" not in meta:
        raise CheckpointError(f"{str(path)!r} carries no fusedtrain_config metadata")
    return state, json.loads(meta["fusedtrain_config"])
