"""Export a TTT training checkpoint to the EAGLE PyTorch drafter layout (config.json + model.safetensors).

Usage: ``eagle-jax-export --checkpoint RUN_DIR[/checkpoints[/STEP]] --out DIR [--dtype bfloat16]``

Needs neither the target nor the data: the checkpoint carries the drafter config and d2t. The
embedding is not written (engines take the target's), as in the published EAGLE checkpoints.
"""

from __future__ import annotations

import argparse

from eagle_jax.training.trainer import export_checkpoint


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--checkpoint", required=True, help="run directory, its checkpoints/ directory, or one step's directory"
    )
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: the checkpoint's, float32)")
    args = p.parse_args(argv)
    step = export_checkpoint(args.checkpoint, args.out, args.dtype)
    print(f"exported step {step} to {args.out}")


if __name__ == "__main__":
    main()
