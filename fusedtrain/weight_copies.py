"""The weight copies an optimizer writes for the fused ops: the one channel between them.

Under bf16 autocast a fused op needs each fp32 weight in bf16. fusedtrain.optim.AdamW
writes that copy in its own pass over the weights (2 bytes a parameter, against 6 read
and written by a separate cast) and publishes it here (`WEIGHT_COPIES.publish`). The ops
ask for it when they cast their parameters (fusedtrain.casts.cast_params ->
`WEIGHT_COPIES.fresh`), and under torch.compile through the op
`fusedtrain::published_cast` (ops/published_cast.py), which asks at run time. A copy
answers only while its parameter is unchanged since it was written: same object, same
storage address, same version counter (in-place writes through the parameter or a view
of it bump the counter; writes through `p.data` do not, so change parameters through
the parameter itself, as load_state_dict and torch.nn.init do).
"""

from __future__ import annotations

import weakref

import torch


class WeightCopies:
    """Copies of parameters in another dtype, each valid while its parameter is unchanged.
    Entries go with their parameters (weak references)."""

    def __init__(self) -> None:
        # id(parameter) -> (weak reference to it, copy, its version and address when
        # published). An id is unique among live objects; the weak reference's callback
        # drops the entry when the parameter dies, before its id can be reused.
        self._entries: dict[int, tuple[weakref.ref, torch.Tensor, int, int]] = {}

    def publish(self, params: list[torch.Tensor], copies: list[torch.Tensor]) -> None:
        """copies[i] holds params[i] cast to copies[i].dtype, as of now."""
        entries = self._entries
        for p, c in zip(params, copies):
            key = id(p)
            entry = entries.get(key)
            if entry is not None and entry[0]() is p:  # republished each step: keep its ref
                ref = entry[0]
            else:
                ref = weakref.ref(p, lambda _, key=key: entries.pop(key, None))
            entries[key] = (ref, c, p._version, p.data_ptr())

    def fresh(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """The copy of t in `dtype`, or of the parameter that t views whole (an
        autograd.Function's output that is its input returned, as the tied head's weight
        from ops.gpt_embedding), while still fresh; else None."""
        param = t._base if t._is_view() and _views_whole(t, t._base) else t
        entry = self._entries.get(id(param))
        if entry is None:
            return None
        ref, copy, version, address = entry
        # A view shares its base's version counter: writes through either are seen.
        fresh = (ref() is param and copy.dtype == dtype and t._version == version
                 and t.data_ptr() == address)
        return copy if fresh else None


def _views_whole(view: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether `view` is all of `base` as it is laid out: same elements, same order."""
    return (view.dtype == base.dtype and view.shape == base.shape
            and view.stride() == base.stride()
            and view.storage_offset() == base.storage_offset())


# The channel fusedtrain's AdamW publishes to and the fused ops read from.
WEIGHT_COPIES = WeightCopies()
