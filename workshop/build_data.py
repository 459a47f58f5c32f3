"""Build the corpus manifest and the tokenizer for the bundled tiny code model.

Usage: ``python -m workshop.build_data --out assets/data [--tokenizer-out assets/tokenizer]``
"""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

from tokenizers import Tokenizer

from workshop.corpus import build_manifest, load_corpus
from workshop.tokenizer_build import train_tokenizer


def main(argv: list[str] | None = None) -> None:
    """Write ``<out>/manifest.json`` and train the tokenizer on the train split."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for manifest.json")
    parser.add_argument("--tokenizer-out", default="assets/tokenizer", help="tokenizer output directory")
    parser.add_argument("--vocab-size", type=int, default=6144)
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    manifest_path = Path(args.out) / "manifest.json"
    manifest = build_manifest(manifest_path)
    print(f"Python {manifest['python']['version']}; corpus sha256 {manifest['corpus_sha256'][:16]}...")
    for split, tot in manifest["totals"].items():
        print(f"  {split:8s} {tot['files']:5d} files {tot['bytes']:>11,d} bytes")
    print(f"wrote {manifest_path}")

    train_texts = load_corpus(manifest_path, "train")
    t1 = time.perf_counter()
    train_tokenizer(train_texts, vocab_size=args.vocab_size, out_dir=args.tokenizer_out)
    tok_path = Path(args.tokenizer_out) / "tokenizer.json"
    tok_hash = hashlib.sha256(tok_path.read_bytes()).hexdigest()
    print(f"trained tokenizer (vocab {args.vocab_size}) in {time.perf_counter() - t1:.1f}s -> {args.tokenizer_out}")
    print(f"tokenizer.json sha256 {tok_hash[:16]}...")
    tok = Tokenizer.from_file(str(tok_path))
    for split in manifest["totals"]:
        texts = train_texts if split == "train" else load_corpus(manifest_path, split)
        n_tokens = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
        print(f"  {split:8s} {n_tokens:>11,d} tokens")
    print(f"total {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
