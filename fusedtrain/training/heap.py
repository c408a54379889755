"""Python's garbage collector kept out of the timed steps: the heap frozen after warm-up."""

from __future__ import annotations

import contextlib
import gc


def freeze_python_heap() -> None:
    """Collect garbage, then move every object alive now (torch, Lightning, the model,
    Triton's and Inductor's caches: ~500k of them) out of the collector's reach until
    gc.unfreeze(), as after a process's warm-up. Python's full collections walk every
    tracked object: on a lent H200 host one took up to 287 ms, landing inside whatever
    step it fell in (four in 40 timed steps of the fused gpt2 step, none after a freeze;
    docs/journal.md). Objects made later are collected as before;
    frozen ones are still freed when their last reference goes, but a reference cycle
    among them only after gc.unfreeze()."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def python_heap_frozen():
    """freeze_python_heap() for the duration of the block."""
    freeze_python_heap()
    try:
        yield
    finally:
        gc.unfreeze()
