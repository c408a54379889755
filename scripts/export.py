"""Export a training checkpoint's model weights to safetensors.

  python scripts/export.py ckpt=outputs/.../checkpoints/last.ckpt out=model.safetensors

The checkpoint is verified (SHA-256 sidecar, or each member's CRC-32) and loaded without
running any code (weights_only); the model config travels as safetensors metadata, so
GPT.from_pretrained("model.safetensors", kernels=...) rebuilds it fused or eager.
Exit status: 0 written; 2 bad arguments or an output path that cannot be written; 3 a
checkpoint that cannot be used.
"""

from __future__ import annotations

import sys
from pathlib import Path

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
    out_dir = Path(args["out"]).expanduser().resolve().parent
    if not out_dir.is_dir():
        print(f"error: out={args['out']}: the directory {str(out_dir)!r} does not exist",
              file=sys.stderr)
        return 2
    try:
        state, cfg = model_state_from_checkpoint(load_checkpoint(args["ckpt"]))
        export_safetensors(state, cfg, args["out"])
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except OSError as e:  # the output could not be written (permissions, a full disk)
        print(f"error: out={args['out']}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote {args['out']}: {len(state)} tensors, "
          f"{sum(v.numel() for v in state.values()):,} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
