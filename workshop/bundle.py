"""Build the bundled drafters for the bundled target (after ``python -m workshop.pretrain_target``).

    python -m workshop.bundle [--target assets/target] [--prompts 640] [--steps 240]

Stages, each skipped when its output exists (rerun the command to resume after a cut-off):
1. completion prompts from the corpus's TRAIN split (``code_prompts``), and the target's own greedy
   continuations of them (``runs/bundle/regen.jsonl``: ``{"prompt", "text"}`` records, the loss on
   ``text`` only), appended batch by batch;
2. the draft vocabulary map (d2t/t2d) from the loss-masked tokens of that data;
3. EAGLE-3 and EAGLE-3.1 (``fc_norm`` + ``norm_output``) drafters trained by ``train.ttt`` with the
   SAME data, steps, batch and learning rate, exported in bf16 to ``assets/drafter-eagle3`` and
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
WORK = Path("runs/bundle")
DRAFT_VOCAB = 2048


def regenerate(target_dir: Path, n_prompts: int, max_new: int, batch: int) -> Path:
    """The target's greedy continuations of train-split code prompts, resumable by record count."""
    out = WORK / "regen.jsonl"
    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = [p["prompt"] for p in code_prompts(load_corpus(MANIFEST, "train"), n_prompts, seed=1, min_chars=200, max_chars=800)]
    done = sum(1 for _ in open(out)) if out.exists() else 0
    if done >= len(prompts):
        return out
    target = load_target(target_dir, dtype="float32")
    eos = tok.convert_tokens_to_ids("<|end_of_text|>")
    WORK.mkdir(parents=True, exist_ok=True)
    for start in range(done - done % batch, len(prompts), batch):
        chunk = prompts[start : start + batch]
        ids = [tok.encode(p, add_special_tokens=False) for p in chunk]
        res = generate(target, None, ids, max_new_tokens=max_new, eos_token_id=eos, tokenizer=tok)
        with open(out, "a") as f:
            for p, text in zip(chunk, res.text):
                f.write(json.dumps({"prompt": p, "text": text}) + "\n")
        print(f"regenerated {start + len(chunk)}/{len(prompts)} ({res.tokens_per_s:.0f} tok/s)", flush=True)
    return out


def vocab_map(target_dir: Path, data: Path) -> Path:
    out = WORK / "vocab_map.npz"
    if not out.exists():
        from eagle_jax.cli.vocab_map import main as build

        build(["--data", str(data), "--tokenizer", str(target_dir), "--target", str(target_dir),
               "--draft-vocab-size", str(DRAFT_VOCAB), "--out", str(out), "--max-length", "1024"])
    return out


def train_drafter(name: str, flags: dict, target_dir: Path, data: Path, vmap: Path, steps: int) -> Path:
    from eagle_jax.training.trainer import load_config, train

    export = Path("assets") / name
    if (export / "model.safetensors").exists():
        return export
    overrides = [
        f"run_dir={WORK / name}", f"target.path={target_dir}", f"data.path={data}", "data.max_length=1024",
        "data.batching=bucket", f"drafter.draft_vocab_size={DRAFT_VOCAB}", f"drafter.vocab_map={vmap}",
        f"drafter.fc_norm={str(flags['fc_norm']).lower()}", f"drafter.norm_output={str(flags['norm_output']).lower()}",
        f"train.steps={steps}", "train.batch_size=4", "train.lr=2e-3", "train.warmup_ratio=0.05", "train.min_lr_ratio=0.05",
        "train.ttt_length=6", f"export.dir={export}", "export.dtype=bfloat16", "checkpoint.every=50", "checkpoint.keep=2",
        "log.every=10",
    ]
    train(load_config(None, overrides))
    return export


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="assets/target")
    ap.add_argument("--prompts", type=int, default=640)
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--only", choices=["eagle3", "eagle3.1"], help="train one drafter (run the two in parallel)")
    args = ap.parse_args(argv)
    target_dir = Path(args.target)
    data = regenerate(target_dir, args.prompts, args.max_new, args.batch)
    vmap = vocab_map(target_dir, data)
    variants = {"eagle3": {"fc_norm": False, "norm_output": False}, "eagle3.1": {"fc_norm": True, "norm_output": True}}
    for v, flags in variants.items():
        if args.only in (None, v):
            print("exported", train_drafter(f"drafter-{v}", flags, target_dir, data, vmap, args.steps))


if __name__ == "__main__":
    main()
