"""Build a drafter's d2t / t2d vocabulary map from training data (SPEC 5).

Usage: ``eagle-jax-vocab-map --data train.jsonl [more.jsonl ...] --tokenizer DIR
--draft-vocab-size 32000 --out vocab_map.npz [--vocab-size V | --target DIR] [--max-length 2048]``

Counts target-token ids at loss-masked (assistant) positions of the data rendered exactly as training
renders it, keeps the most frequent ``draft-vocab-size`` ids, writes ``d2t`` (int64 offsets) and
``t2d`` (bool) to an .npz that ``configs/train/*.yaml`` (``drafter.vocab_map``) reads.
"""

from __future__ import annotations

import argparse

from eagle_jax.checkpoint.hub import resolve_checkpoint
from eagle_jax.config import TargetConfig
from eagle_jax.training.data import load_samples
from eagle_jax.training.vocab_map import build_vocab_map, coverage, save_vocab_map, token_counts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", nargs="+", required=True, help="JSONL files (chat, ShareGPT or text records)")
    p.add_argument("--tokenizer", required=True, help="the target's tokenizer directory")
    p.add_argument("--draft-vocab-size", type=int, required=True)
    p.add_argument("--out", required=True, help="output .npz")
    p.add_argument("--vocab-size", type=int, help="target vocabulary size (default: --target's, else len(tokenizer))")
    p.add_argument("--target", help="target checkpoint directory or Hub repo id (for its vocab_size)")
    p.add_argument("--max-length", type=int, default=2048, help="drop longer samples, as training does")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer  # after parsing: --help stays fast

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = args.vocab_size or (TargetConfig.from_pretrained(resolve_checkpoint(args.target)).vocab_size if args.target else len(tok))
    samples, stats = load_samples(args.data, tok, args.max_length)
    print(stats.summary())
    counts = token_counts(samples, vocab)
    d2t, t2d = build_vocab_map(counts, args.draft_vocab_size)
    save_vocab_map(args.out, d2t, t2d)
    print(
        f"kept {args.draft_vocab_size} of {vocab} ids ({int((counts > 0).sum())} seen); they cover "
        f"{100 * coverage(counts, t2d):.2f}% of loss tokens -> {args.out}"
    )


if __name__ == "__main__":
    main()
