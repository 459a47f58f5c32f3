"""Drafter starts at equal data and steps: from scratch, warm (head, final norm and fc from the target) and warm with
the head and norm frozen, for EAGLE-3 and EAGLE-3.1. Reports held-out per-position TTT accuracy (``eval.path`` of
the recipe) and acceptance length through the engine on MT-bench and GSM8K.

    python -m bench.warm_start --config configs/train/smollm2_135m.yaml --steps 40 \
        --set eval.path=runs/heldout/mt_bench_gsm8k.jsonl --set eval.features=runs/heldout/features

Every run trains in its own directory under ``--runs`` and stops after ``--steps`` (resumable: a run already there
continues); its checkpoint at that step is exported and measured with ``bench.acceptance`` (chain K, greedy).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import acceptance
from bench.common import print_table, write_json
from eagle_jax.training.trainer import export_checkpoint, load_config, train

STARTS = {
    "scratch": [],
    "warm": ["drafter.warm_start=[lm_head, norm, fc]"],
    "warm-frozen": ["drafter.warm_start=[lm_head, norm, fc]", "train.freeze=[lm_head, norm]"],
}
KINDS = {
    "EAGLE-3": ["drafter.fc_norm=false", "drafter.norm_output=false"],
    "EAGLE-3.1": ["drafter.fc_norm=true", "drafter.norm_output=true"],
}


def heldout_at(run_dir: Path, step: int) -> dict:
    for line in (run_dir / "log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["step"] == step and "heldout_acc_per_position" in rec:
            return rec
    raise SystemExit(
        f"{run_dir}: no held-out record at step {step}; set eval.path and eval.every (a divisor of --steps)"
    )


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="training recipe (YAML)")
    ap.add_argument("--set", action="append", default=[], help="recipe override key=value, for every run")
    ap.add_argument("--steps", type=int, required=True, help="steps of every run (the comparison point)")
    ap.add_argument("--starts", nargs="+", default=list(STARTS), choices=list(STARTS))
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--runs", default="runs/warm_start", help="one run directory per start and kind below this")
    ap.add_argument(
        "--questions", nargs="+", default=["../shared/data/eval/mt_bench.jsonl", "../shared/data/eval/gsm8k.jsonl"]
    )
    ap.add_argument("--n-questions", type=int, default=16)
    ap.add_argument("--k", type=int, default=3, help="chain depth of the acceptance measurement")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument(
        "--baselines",
        nargs="*",
        default=["assets/smollm2/drafter-eagle3", "assets/smollm2/drafter-eagle3.1"],
        help="drafters measured beside the runs' (acceptance only)",
    )
    ap.add_argument("--out", default="bench/results/warm_start.json")
    args = ap.parse_args(argv)

    runs, drafters = [], {}
    for kind in args.kinds:
        for start in args.starts:
            run_dir = Path(args.runs) / f"{kind}-{start}"
            cfg = load_config(
                args.config,
                [
                    *args.set,
                    *KINDS[kind],
                    *STARTS[start],
                    f"run_dir={run_dir}",
                    f"eval.every={args.steps}",
                    f"log.every={args.steps}",
                ],
            )
            train(cfg, stop_after=args.steps)
            rec = heldout_at(run_dir, args.steps)
            out = (
                Path(args.runs) / "exports" / f"{kind}-{start}-step{args.steps}"
            )  # bench.acceptance names a drafter by its folder
            export_checkpoint(run_dir / "checkpoints", out)
            drafters[f"{kind}-{start}"] = str(out)
            runs.append(
                {
                    "kind": kind,
                    "start": start,
                    "run_dir": str(run_dir),
                    "step": args.steps,
                    "train_acc_per_position": rec["acc_per_position"],
                    **{k: v for k, v in rec.items() if k.startswith("heldout")},
                }
            )
    target = load_config(args.config, args.set)["target"]["path"]
    acc = acceptance.main(
        [
            "--target",
            target,
            "--drafters",
            *drafters.values(),
            *args.baselines,
            "--ks",
            str(args.k),
            "--trees",
            "--temperatures",
            "0",
            "--n-prompts",
            "0",
            "--questions",
            *args.questions,
            "--n-questions",
            str(args.n_questions),
            "--max-new",
            str(args.max_new),
            "--batch-size",
            "16",
            "--out",
            str(Path(args.out).with_suffix(".acceptance.json")),
            "--plot",
            "",
        ]
    )
    for run in runs:
        folder = Path(drafters[f"{run['kind']}-{run['start']}"]).name
        run["al"] = {r["dataset"]: r["al_mean"] for r in acc["runs"] if r["drafter"].startswith(folder + " (")}
    rows = [
        [
            r["kind"],
            r["start"],
            " ".join(f"{a:.3f}" for a in r["heldout_acc_per_position"]),
            f"{r['heldout_simulated_al']:.2f}",
            " ".join(f"{a:.3f}" for a in r["train_acc_per_position"]),
            *(f"{r['al'].get(Path(q).stem, float('nan')):.2f}" for q in args.questions),
        ]
        for r in runs
    ]
    print_table(
        [
            "kind",
            "start",
            "held-out TTT acc per position",
            "sim. AL",
            "train acc (last log)",
            *(f"AL K={args.k} {Path(q).stem}" for q in args.questions),
        ],
        rows,
    )
    baselines = {
        b: {r["dataset"]: r["al_mean"] for r in acc["runs"] if r["drafter"].startswith(Path(b).name + " (")}
        for b in args.baselines
    }
    if baselines:
        print_table(
            ["baseline", *(f"AL K={args.k} {Path(q).stem}" for q in args.questions)],
            [
                [b, *(f"{al.get(Path(q).stem, float('nan')):.2f}" for q in args.questions)]
                for b, al in baselines.items()
            ],
        )
    result = {"settings": vars(args), "runs": runs, "baselines": baselines}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
