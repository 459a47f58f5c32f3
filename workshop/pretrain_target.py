"""Pretrain the bundled tiny code target on the standard library's Python source.

    python -m workshop.pretrain_target --out runs/target --export assets/target [--steps N] [--seq-len T]
        [--long-steps N --long-seq-len 2048] [--init-from DIR] [--with-packages [--stdlib-repeats N]]

``--init-from`` continues pretraining from an exported target (fresh optimiser state and schedule);
the bundled target's card gives the recipe it was made with.

Builds the corpus manifest and tokenizer first if missing (``python -m workshop.build_data``), resumes
from ``<out>/ckpt`` if present, and at the end exports an HF directory (config.json,
model.safetensors in bf16, tokenizer files) that transformers' LlamaForCausalLM also loads.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np

from eagle_jax.config import RopeConfig, TargetConfig
from workshop.corpus import load_corpus
from workshop.pretrain import PretrainConfig, pretrain

DATA = Path("assets/data/manifest.json")
PACKAGES = Path("assets/data/packages.json")
TOKENIZER = Path("assets/tokenizer")


def target_config(vocab_size: int, bos: int, eos: int) -> TargetConfig:
    """12 layers x 384, GQA 6 q / 2 kv heads, RoPE, 2048 context, tied embeddings."""
    return TargetConfig(
        architecture="llama",
        vocab_size=vocab_size,
        hidden_size=384,
        intermediate_size=1024,
        num_layers=12,
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=10000.0),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
    )


def token_stream(split: str, tokenizer_dir: Path, cache: Path, manifest: Path = DATA) -> np.ndarray:
    """The split's files tokenized and joined by <|end_of_text|>, cached as .npy."""
    if cache.exists():
        return np.load(cache)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    sep = tok.token_to_id("<|end_of_text|>")
    ids: list[int] = []
    for enc in tok.encode_batch(load_corpus(manifest, split), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(sep)
    arr = np.asarray(ids, np.uint16)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.save(cache, arr)
    return arr


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/target")
    ap.add_argument("--export", default="assets/target")
    ap.add_argument("--steps", type=int, default=PretrainConfig.steps)
    ap.add_argument("--batch", type=int, default=PretrainConfig.batch)
    ap.add_argument("--seq-len", type=int, default=PretrainConfig.seq_len)
    ap.add_argument("--lr", type=float, default=PretrainConfig.lr)
    ap.add_argument("--save-every", type=int, default=PretrainConfig.save_every)
    ap.add_argument("--long-steps", type=int, default=0, help="train the last N steps on --long-seq-len windows")
    ap.add_argument("--long-seq-len", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=PretrainConfig.warmup)
    ap.add_argument("--seed", type=int, default=PretrainConfig.seed)
    ap.add_argument(
        "--with-packages",
        action="store_true",
        help="train on permissively licensed package source too (corpus.PACKAGES, pinned in assets/data/packages.json, "
        "built when missing); the held-out split stays the standard library's. Tried and not used for the "
        "bundled target: it raised the standard library's held-out loss",
    )
    ap.add_argument(
        "--stdlib-repeats",
        type=int,
        default=1,
        help="with --with-packages: the standard library's stream repeated N times (its share of the windows)",
    )
    ap.add_argument(
        "--init-from", default=None, help="an HF target directory to continue pretraining from (fresh optimiser)"
    )
    args = ap.parse_args(argv)
    if not DATA.exists() or not (TOKENIZER / "tokenizer.json").exists():
        from workshop.build_data import main as build_data

        build_data(["--out", str(DATA.parent), "--tokenizer-out", str(TOKENIZER)])
    out = Path(args.out)
    stream = token_stream("train", TOKENIZER, out / "train_tokens.npy")
    if args.with_packages:
        if not PACKAGES.exists():
            from workshop.corpus import PACKAGES as DISTRIBUTIONS
            from workshop.corpus import build_manifest

            build_manifest(PACKAGES, packages=DISTRIBUTIONS)
        packages = token_stream("train", TOKENIZER, out / "packages_tokens.npy", PACKAGES)
        # Windows are drawn uniformly from the stream, so repeating the standard library upweights it.
        stream = np.concatenate([stream] * args.stdlib_repeats + [packages])
    heldout = token_stream("heldout", TOKENIZER, out / "heldout_tokens.npy")
    print(f"train stream {len(stream):,} tokens, heldout {len(heldout):,}")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    config = target_config(len(tok), tok.bos_token_id, tok.eos_token_id)
    cfg = PretrainConfig(
        steps=args.steps,
        batch=args.batch,
        seq_len=args.seq_len,
        lr=args.lr,
        save_every=args.save_every,
        long_steps=args.long_steps,
        long_seq_len=args.long_seq_len,
        warmup=args.warmup,
        seed=args.seed,
    )
    target = pretrain(config, stream, heldout, cfg, out, init_from=args.init_from)
    from eagle_jax.checkpoint.hf_target import save_target

    export = Path(args.export)
    save_target(target, export, dtype="bfloat16")
    for f in TOKENIZER.iterdir():
        shutil.copy(f, export / f.name)
    print(f"exported {export}")


if __name__ == "__main__":
    main()
