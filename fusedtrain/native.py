"""The compiled replay module (fusedtrain/csrc/replay.cpp), built once per source and
torch build with the system's C++ compiler and loaded; None where it cannot be.

Why a compiled module: a Python autograd.Function costs more host time per call than
PyTorch's own ops do with all their work (docs/performance.md, "Host cost"). The module
replays an op's recorded launches from one C++ autograd node (fusedtrain/ops/_replay.py).

Built by one g++ -O3 command against torch's headers (torch.utils.cpp_extension.load
would also need ninja) into `$FUSEDTRAIN_CACHE` (default
~/.cache/fusedtrain), keyed by the source, torch's version and the Python ABI: ~40-60 s the
first time on one core, a dlopen after. FUSEDTRAIN_REPLAY=0 skips it (every op then runs
its Python Function, as without a compiler).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("fusedtrain")

SOURCE = Path(__file__).parent / "csrc" / "replay.cpp"
NAME = "fusedtrain_replay"
ENABLED = os.environ.get("FUSEDTRAIN_REPLAY", "1") != "0"

_module: ModuleType | None = None
_tried = False


def _cache_dir() -> Path:
    root = os.environ.get("FUSEDTRAIN_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "fusedtrain")
    return Path(root)


def _build(target: Path) -> None:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [compiler, "-O3", "-std=c++17", "-shared", "-fPIC", "-w",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_EXTENSION_NAME=" + NAME,
           "-I", sysconfig.get_paths()["include"]]
    for path in cpp_extension.include_paths():
        cmd += ["-isystem", path]
    for path in cpp_extension.library_paths():
        cmd += ["-L", path, f"-Wl,-rpath,{path}"]
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd += [str(SOURCE), "-o", str(out), "-lc10", "-ltorch", "-ltorch_cpu",
                "-ltorch_python", "-ldl"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:3])} ... failed:\n{done.stderr[-4000:]}")
        os.replace(out, target)  # atomic: a concurrent builder's copy is as good


def load() -> ModuleType | None:
    """The replay module, built if needed; None (logged once, with why) if disabled or it
    cannot be built or loaded."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if not ENABLED:
        log.info("replay: off (FUSEDTRAIN_REPLAY=0); every op runs its Python Function")
        return None
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + torch.__version__.encode() + sys.version.encode()
                         + str(torch._C._GLIBCXX_USE_CXX11_ABI).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{NAME}-{tag}{sysconfig.get_config_var('EXT_SUFFIX')}"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            log.info("replay: building %s (once per source and torch build)", target.name)
            _build(target)
        spec = importlib.util.spec_from_file_location(NAME, target)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as e:  # no compiler, headers or loader: the Python Functions serve
        log.warning("replay: unavailable, every op runs its Python Function: %s", e)
        return None
    _module = module
    log.info("replay: ops replay their recorded launches from C++ nodes (%s)", target)
    return module
