"""Export a training checkpoint's model weights to safetensors.

  python scripts/export.py ckpt=outputs/.../checkpoints/last.ckpt out=model.safetensors

The checkpoint is verified (SHA-256 sidecar) and loaded without running any code
(weights_only); the model config travels as safetensors metadata, so
GPT.from_pretrained("model.safetensors", kernels=...) rebuilds it fused or eager.
"""

from __future__ import annotations

import sys

from fusedtrain.training.checkpoint import (
    CheckpointError,
    export_safetensors,
    load_checkpoint,
    model_state_from_checkpoint,
)


def main(argv: list[str]) -> int:
    args = dict(a.split("=", 1) for a in argv if "=" in a)
    unknown = set(args) - {"ckpt", "out"}
    if unknown or "ckpt" not in args or "out" not in args or len(args) != len(argv):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        state, cfg = model_state_from_checkpoint(load_checkpoint(args["ckpt"]))
        export_safetensors(state, cfg, args["out"])
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    print(f"wrote {args['out']}: {len(state)} tensors, "
          f"{sum(v.numel() for v in state.values()):,} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
