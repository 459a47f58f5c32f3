"""Build the bundled drafters for the bundled target (after ``python -m workshop.pretrain_target``).

    python -m workshop.bundle [--target assets/target] [--prompts 640] [--steps 240]      # the bundled drafters
    python -m workshop.bundle --target <dir> --long-prompts 64 --max-length 2048 --steps 200 \
        --work runs/bundle2 --export-root runs/bundle2/export              # BENCHMARKS' "Rebuilt pair"

Stages, each skipped when its output exists (rerun the command to resume after a cut-off):
1. completion prompts from the corpus's TRAIN split (``code_prompts``): ``--prompts`` short ones (200-800
   characters of context) and ``--long-prompts`` long ones (none by default; 4000-6400 characters,
   ~1100-1800 tokens, so the drafters learn to read long histories), and the target's own greedy continuations of them
   (``runs/bundle/regen.jsonl``: ``{"prompt", "text"}`` records, the loss on ``text`` only), appended
   batch by batch;
2. the draft vocabulary map (d2t/t2d) from the loss-masked tokens of that data;
3. EAGLE-3 and EAGLE-3.1 (``fc_norm`` + ``norm_output``) drafters trained by ``train.ttt`` with the
   SAME data, steps, batch and learning rate, batched by length (four buckets up to --max-length:
   short samples cost short-sequence attention), exported in bf16 to ``assets/drafter-eagle3`` and
   ``assets/drafter-eagle3.1`` in the EAGLE PyTorch layout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers import AutoTokenizer

from eagle_jax import load_target
from eagle_jax.generate import generate
from workshop.corpus import code_prompts, load_corpus

MANIFEST = Path("assets/data/manifest.json")
DRAFT_VOCAB = 2048


def regenerate(
    work: Path, target_dir: Path, n_prompts: int, n_long: int, max_new: int, batch: int, max_length: int
) -> Path:
    """The target's greedy continuations of train-split code prompts, resumable by record count."""
    out = work / "regen.jsonl"
    tok = AutoTokenizer.from_pretrained(target_dir)
    texts = load_corpus(MANIFEST, "train")
    prompts = [p["prompt"] for p in code_prompts(texts, n_prompts, seed=1, min_chars=200, max_chars=800)]
    # Long prompts: kept when prompt + continuation fit in max_length tokens (dense files can exceed it).
    long = [p["prompt"] for p in code_prompts(texts, n_long, seed=2, min_chars=4000, max_chars=6400)]
    prompts += [p for p in long if len(tok.encode(p, add_special_tokens=False)) + max_new < max_length]
    done = sum(1 for _ in open(out)) if out.exists() else 0
    if done >= len(prompts):
        return out
    target = load_target(target_dir, dtype="float32")
    eos = tok.convert_tokens_to_ids("<|end_of_text|>")
    work.mkdir(parents=True, exist_ok=True)
    for start in range(done - done % batch, len(prompts), batch):
        chunk = prompts[start : start + batch]
        ids = [tok.encode(p, add_special_tokens=False) for p in chunk]
        res = generate(target, None, ids, max_new_tokens=max_new, eos_token_id=eos, tokenizer=tok)
        with open(out, "a") as f:
            for p, text in zip(chunk, res.text):
                f.write(json.dumps({"prompt": p, "text": text}) + "\n")
        print(f"regenerated {start + len(chunk)}/{len(prompts)} ({res.tokens_per_s:.0f} tok/s)", flush=True)
    return out


def vocab_map(work: Path, target_dir: Path, data: Path, max_length: int) -> Path:
    out = work / "vocab_map.npz"
    if not out.exists():
        from eagle_jax.cli.vocab_map import main as build

        build(
            [
                "--data",
                str(data),
                "--tokenizer",
                str(target_dir),
                "--target",
                str(target_dir),
                "--draft-vocab-size",
                str(DRAFT_VOCAB),
                "--out",
                str(out),
                "--max-length",
                str(max_length),
            ]
        )
    return out


def train_drafter(
    work: Path,
    export: Path,
    flags: dict,
    target_dir: Path,
    data: Path,
    vmap: Path,
    steps: int,
    batch: int,
    max_length: int,
    remat: bool = False,
) -> Path:
    from eagle_jax.training.trainer import load_config, train

    if (export / "model.safetensors").exists():
        return export
    overrides = [
        f"run_dir={work / export.name}",
        f"target.path={target_dir}",
        f"data.path={data}",
        f"data.max_length={max_length}",
        "data.batching=bucket",
        f"drafter.draft_vocab_size={DRAFT_VOCAB}",
        f"drafter.vocab_map={vmap}",
        f"drafter.fc_norm={str(flags['fc_norm']).lower()}",
        f"drafter.norm_output={str(flags['norm_output']).lower()}",
        f"train.steps={steps}",
        f"train.batch_size={batch}",
        "train.lr=2e-3",
        "train.warmup_ratio=0.05",
        "train.min_lr_ratio=0.05",
        "train.ttt_length=6",
        f"export.dir={export}",
        "export.dtype=bfloat16",
        "checkpoint.every=50",
        "checkpoint.keep=2",
        "log.every=10",
        f"train.remat={str(remat).lower()}",
    ]
    train(load_config(None, overrides))
    return export


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="assets/target")
    ap.add_argument("--prompts", type=int, default=640)
    ap.add_argument("--long-prompts", type=int, default=0)
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--batch", type=int, default=32, help="regeneration batch")
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--max-length", type=int, default=1024, help="longest training sample (2048 with --long-prompts)")
    ap.add_argument("--train-batch", type=int, default=4, help="samples per training step")
    ap.add_argument("--work", default="runs/bundle", help="regenerated data, vocabulary map and training runs")
    ap.add_argument("--export-root", default="assets", help="drafters are exported to <root>/drafter-eagle3{,.1}")
    ap.add_argument(
        "--remat", action="store_true", help="recompute the TTT steps in the backward pass (less memory, same result)"
    )
    ap.add_argument("--only", choices=["eagle3", "eagle3.1"], help="train one drafter (run the two in parallel)")
    args = ap.parse_args(argv)
    target_dir = Path(args.target)
    work = Path(args.work)
    data = regenerate(work, target_dir, args.prompts, args.long_prompts, args.max_new, args.batch, args.max_length)
    vmap = vocab_map(work, target_dir, data, args.max_length)
    variants = {"eagle3": {"fc_norm": False, "norm_output": False}, "eagle3.1": {"fc_norm": True, "norm_output": True}}
    for v, flags in variants.items():
        if args.only in (None, v):
            print(
                "exported",
                train_drafter(
                    work,
                    Path(args.export_root) / f"drafter-{v}",
                    flags,
                    target_dir,
                    data,
                    vmap,
                    args.steps,
                    args.train_batch,
                    args.max_length,
                    args.remat,
                ),
            )


if __name__ == "__main__":
    main()
