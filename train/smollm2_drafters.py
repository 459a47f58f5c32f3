"""SmolLM2-135M-Instruct's two drafters from scratch on one machine: the target writes the conversations, then
EAGLE-3.1 and EAGLE-3 train on them, and both are exported (EAGLE layout) under ``--out``.

    python -m train.smollm2_drafters --out drafters --conversations 20000      # an accelerator (sized for one H200)
    python -m train.smollm2_drafters --out /tmp/d --conversations 4 --max-new-tokens 8 --steps 2 --gen-batch 4 \\
        --train-batch 1 --max-length 256                                          # the same path at tiny scale (CPU)

Every stage resumes: the conversations are written in shards (``eagle-jax-regenerate``), the runs keep checkpoints
(``eagle-jax-train``), so the same command continues after an interruption. The recipe is
``configs/train/smollm2_135m.yaml`` with this data; the target runs inside every train step (``data.features``
off: the stored features of 20k conversations would take ~80 GB of float32). Steps default to about two epochs.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from eagle_jax.cli import regenerate, ttt

RECIPE = "configs/train/smollm2_135m.yaml"
KINDS = {
    "eagle3.1": ["drafter.fc_norm=true", "drafter.norm_output=true"],
    "eagle3": ["drafter.fc_norm=false", "drafter.norm_output=false"],
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the drafters go to OUT/drafter-eagle3.1 and OUT/drafter-eagle3")
    p.add_argument("--work", default="runs/smollm2-drafters", help="conversations, runs and checkpoints")
    p.add_argument("--conversations", type=int, default=20000)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--gen-batch", type=int, default=256, help="conversations generated at once")
    p.add_argument("--train-batch", type=int, default=32, help="packed rows per train step")
    p.add_argument("--max-length", type=int, default=1024, help="tokens per packed row")
    p.add_argument("--steps", type=int, default=None, help="train steps per drafter (default: ~2 epochs)")
    p.add_argument(
        "--seed", type=int, default=7, help="of the synthesised user turns (other seeds than the bundled data's)"
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="recipe overrides for both runs",
    )
    args = p.parse_args(argv)

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "magpie.jsonl"
    if not data.exists():  # a finished generation is kept; an unfinished one resumes from its shards
        regenerate.main(
            [
                "--target",
                "smollm2-135m-instruct",
                "--synthesize",
                str(args.conversations),
                "--out",
                str(data),
                "--max-new-tokens",
                str(args.max_new_tokens),
                "--batch-size",
                str(args.gen_batch),
                "--shard-size",
                str(4 * args.gen_batch),
                "--seed",
                str(args.seed),
            ]
        )
    if args.steps is None:  # ~2 epochs: ~420 tokens a conversation (BENCHMARKS.md), rows ~70% full
        tokens = 420 * sum(1 for _ in data.open())
        args.steps = max(1, round(2 * tokens / (0.7 * args.train_batch * args.max_length)))
    for kind, flags in KINDS.items():
        ttt.main(
            [
                "--config",
                RECIPE,
                *[
                    a
                    for f in (
                        *flags,
                        f"run_dir={work / kind}",
                        f"data.path=[{data}]",
                        "data.features=null",
                        f"data.max_length={args.max_length}",
                        f"train.batch_size={args.train_batch}",
                        f"train.steps={args.steps}",
                        *args.overrides,
                    )
                    for a in ("--set", f)
                ],
            ]
        )
        dest = Path(args.out) / f"drafter-{kind}"
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(work / kind / "export", dest)
    print(json.dumps({"out": args.out, "steps": args.steps, "conversations": str(data)}))


if __name__ == "__main__":
    main()
