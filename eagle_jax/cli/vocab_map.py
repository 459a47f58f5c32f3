"""Build a drafter's d2t / t2d vocabulary map from training data.

Usage: ``eagle-jax-vocab-map --data train.jsonl [more.jsonl ...] [--target T] [--tokenizer T]
--draft-vocab-size 32000 --out vocab_map.npz [--vocab-size V] [--max-length 2048]``

T: an HF checkpoint directory or Hub repo id, a .gguf file, or a named model (``smollm2-135m-instruct``,
``gemma-3-270m``).
One of --target and --tokenizer at least: the tokenizer defaults to the target's, the vocabulary size
to the target's, else the tokenizer's length.

Counts target-token ids at loss-masked (assistant) positions of the data rendered exactly as training
renders it, keeps the most frequent ``draft-vocab-size`` ids, writes ``d2t`` (int64 offsets) and
``t2d`` (bool) to an .npz that ``configs/train/*.yaml`` (``drafter.vocab_map``) reads.
"""

from __future__ import annotations

import argparse
import os

from eagle_jax.checkpoint.hub import resolve_checkpoint
from eagle_jax.checkpoint.models import resolve_model
from eagle_jax.checkpoint.tokenizer import is_gguf_file, load_tokenizer
from eagle_jax.config import TargetConfig
from eagle_jax.training.data import load_samples
from eagle_jax.training.vocab_map import build_vocab_map, coverage, save_vocab_map, token_counts


def target_vocab_size(target: str | os.PathLike) -> int:
    """The target's vocabulary size from its config alone (no weights read): config.json of a checkpoint
    directory or Hub repo, or the metadata of a .gguf file (a named model is fetched first)."""
    source = resolve_model(target)
    if is_gguf_file(source):
        from eagle_jax.checkpoint.gguf import gguf_target_config

        return gguf_target_config(source).vocab_size
    return TargetConfig.from_pretrained(resolve_checkpoint(source)).vocab_size


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", nargs="+", required=True, help="JSONL files (chat, ShareGPT or text records)")
    p.add_argument(
        "--tokenizer",
        help="the target's tokenizer: a directory, Hub repo id, .gguf file or named model (default: --target's)",
    )
    p.add_argument("--draft-vocab-size", type=int, required=True)
    p.add_argument("--out", required=True, help="output .npz")
    p.add_argument("--vocab-size", type=int, help="target vocabulary size (default: --target's, else len(tokenizer))")
    p.add_argument(
        "--target",
        help="HF target checkpoint directory or Hub repo id, a .gguf file, or smollm2-135m-instruct "
        "(for its vocab_size, and its tokenizer when --tokenizer is not given)",
    )
    p.add_argument("--max-length", type=int, default=2048, help="drop longer samples, as training does")
    args = p.parse_args(argv)
    if not (args.tokenizer or args.target):
        p.error("give --tokenizer or --target (whose tokenizer is then used)")
    tok = load_tokenizer(args.tokenizer or args.target)
    vocab = args.vocab_size or (target_vocab_size(args.target) if args.target else len(tok))
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
