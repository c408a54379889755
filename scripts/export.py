"""Export a training checkpoint's model weights to safetensors.

  python scripts/export.py ckpt=outputs/.../checkpoints/last.ckpt out=model.safetensors
  python scripts/export.py ckpt=... out=DIR format=hf [vocab=N]

format=hf writes a directory that transformers.GPT2LMHeadModel.from_pretrained(DIR) loads,
or LlamaForCausalLM for a model with Llama's block (model=llama-*; fusedtrain.hf,
fusedtrain.hf_llama; needs the [hf] extra): the token table cut to the tokenizer's vocab=N
rows (default: the training run's tokenizer, read from the run dir's .hydra/config.yaml
beside checkpoints/; else the model's vocab_size).

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
    unknown = set(args) - {"ckpt", "out", "format", "vocab"}
    if unknown or "ckpt" not in args or "out" not in args or len(args) != len(argv):
        print(__doc__, file=sys.stderr)
        return 2
    fmt = args.get("format", "safetensors")
    if fmt not in ("safetensors", "hf"):
        print(f"error: format={fmt}: must be safetensors or hf", file=sys.stderr)
        return 2
    if "vocab" in args and (fmt != "hf" or not args["vocab"].isdigit()):
        print(f"error: vocab={args['vocab']}: a positive integer, with format=hf",
              file=sys.stderr)
        return 2
    out_dir = Path(args["out"]).expanduser().resolve().parent
    if not out_dir.is_dir():
        print(f"error: out={args['out']}: the directory {str(out_dir)!r} does not exist",
              file=sys.stderr)
        return 2
    try:
        state, cfg = model_state_from_checkpoint(load_checkpoint(args["ckpt"]))
        if fmt == "hf":
            _export_hf(state, cfg, args)
        else:
            export_safetensors(state, cfg, args["out"])
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except (ValueError, ImportError) as e:  # a model transformers cannot hold, no extra
        print(f"error: format=hf: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the output could not be written (permissions, a full disk)
        print(f"error: out={args['out']}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote {args['out']}: {len(state)} tensors, "
          f"{sum(v.numel() for v in state.values()):,} parameters")
    return 0


def _export_hf(state: dict, cfg: dict, args: dict) -> None:
    from fusedtrain.hf import export_hf, tokenizer_vocab

    trained = tokenizer_vocab(Path(args["ckpt"]).resolve().parent.parent)
    vocab = int(args["vocab"]) if "vocab" in args else trained[0] if trained else None
    export_hf(state, cfg, args["out"], vocab, trained[1] if trained else None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
