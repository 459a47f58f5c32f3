"""A served model for the serving tests: the hand-built Markov pair (drafts often accepted) saved as
real checkpoint directories, with a character-level HF tokenizer and a chat template.

The tokenizer has one more token than the model: its EOS (id ``VOCAB``) can never be generated, so a
request ends at ``max_tokens`` or a stop string, never by chance; EOS handling is tested on the engine
directly (test_serving.py).
"""

from __future__ import annotations

from pathlib import Path

from engine_models import markov_drafter, markov_target

import eagle_jax

CHARS = "abcdefghijklmnopqrstuvwxyz .,!?"  # ids 0..30
VOCAB = 32  # the model's vocabulary: the characters and one id (31) that decodes to nothing
EOS = "</s>"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }}. {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab["<pad>"] = VOCAB - 1
    vocab[EOS] = VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token="<pad>", chat_template=CHAT_TEMPLATE)


def save_pair(root: Path) -> tuple[Path, Path]:
    """Writes target (with its tokenizer) and drafter directories under ``root``; returns their paths."""
    target, succ = markov_target(vocab=VOCAB, hidden=64, seed=0, eps=0.1)
    drafter, _ = markov_drafter(target, succ, seed=0, disagree=0.25)
    t_dir, d_dir = root / "target", root / "drafter"
    eagle_jax.save_target(target, t_dir)
    eagle_jax.save_drafter(drafter, d_dir)
    build_tokenizer().save_pretrained(t_dir)
    return t_dir, d_dir
