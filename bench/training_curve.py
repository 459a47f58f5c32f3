"""Held-out simulated AL and loss against trained tokens, from training runs' logs (``eval.path`` records).

    python -m bench.training_curve runs/smollm2-eagle3.1 runs/smollm2-eagle3 \\
        --out bench/figures/smollm2_training_curve.png

Tokens are the supervised (loss) tokens seen so far, summed over the log's records; a run continued in another
directory (``drafter.init``) is drawn after the runs before it when given as ``A+B`` (B's tokens start where A's end).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import print_table, write_json


def curve(run_dirs: list[Path]) -> list[dict]:
    """[{tokens, step, heldout_simulated_al, heldout_loss_0, acc_0, ...}] of the held-out records, in order."""
    points, seen = [], 0
    for run_dir in run_dirs:
        for line in (run_dir / "log.jsonl").read_text().splitlines():
            rec = json.loads(line)
            seen += rec["loss_tokens"]
            if "heldout_simulated_al" in rec:
                points.append(
                    {
                        "run": run_dir.name,
                        "step": rec["step"],
                        "tokens": seen,
                        "heldout_simulated_al": rec["heldout_simulated_al"],
                        "heldout_acc_per_position": rec["heldout_acc_per_position"],
                        "heldout_loss_0": rec["heldout_loss_per_position"][0],
                        "train_acc_0": rec["acc_per_position"][0] if "acc_per_position" in rec else None,
                    }
                )
    return points


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories; A+B: B continues A")
    ap.add_argument("--out", default="bench/figures/training_curve.png")
    args = ap.parse_args(argv)
    curves = {spec: curve([Path(p) for p in spec.split("+")]) for spec in args.runs}
    rows = [
        [
            spec,
            p["step"],
            p["tokens"],
            f"{p['heldout_simulated_al']:.3f}",
            " ".join(f"{a:.3f}" for a in p["heldout_acc_per_position"]),
            f"{p['heldout_loss_0']:.3f}",
            "-" if p["train_acc_0"] is None else f"{p['train_acc_0']:.3f}",
        ]
        for spec, pts in curves.items()
        for p in pts
    ]
    print_table(
        [
            "run",
            "step",
            "loss tokens",
            "held-out sim. AL",
            "held-out acc per position",
            "held-out loss pos 0",
            "train acc 0",
        ],
        rows,
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for spec, pts in curves.items():
        x = [p["tokens"] / 1e3 for p in pts]
        ax1.plot(x, [p["heldout_simulated_al"] for p in pts], marker="o", label=spec)
        ax2.plot(x, [p["heldout_loss_0"] for p in pts], marker="o", label=spec)
    ax1.set(xlabel="trained tokens (k)", ylabel="held-out simulated AL", title="held-out simulated AL")
    ax2.set(xlabel="trained tokens (k)", ylabel="held-out loss, first draft", title="held-out loss")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    result = {"curves": curves, "figure": args.out}
    write_json(Path(args.out).with_suffix(".json"), result)
    return result


if __name__ == "__main__":
    main()
