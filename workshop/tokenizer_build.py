"""Byte-level BPE tokenizer for the bundled tiny code model.

``train_tokenizer`` writes ``tokenizer.json``, ``tokenizer_config.json`` and
``special_tokens_map.json`` so that ``transformers.AutoTokenizer.from_pretrained(out_dir)``
loads a fast tokenizer with a chat template whose assistant turns are wrapped in
``{% generation %}`` blocks (for ``return_assistant_tokens_mask=True``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS_TOKEN = "<|begin_of_text|>"
EOT_TOKEN = "<|end_of_text|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SYSTEM_TOKEN = "<|system|>"
END_TOKEN = "<|end|>"
PAD_TOKEN = "<|pad|>"

# Order fixes the ids: 0..6.
SPECIAL_TOKENS = [BOS_TOKEN, EOT_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, END_TOKEN, PAD_TOKEN, SYSTEM_TOKEN]

# Each message: "<|role|>\n{content}<|end|>\n". The assistant content and its closing <|end|>
# are inside {% generation %} so that return_assistant_tokens_mask marks exactly them.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "{{ '<|user|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'system' %}"
    "{{ '<|system|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\n' }}"
    "{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ raise_exception('Unsupported chat role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def _build_tokenizer_model(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def train_tokenizer(
    texts: list[str],
    vocab_size: int = 6144,
    out_dir: str | os.PathLike = "assets/tokenizer",
    model_max_length: int = 2048,
) -> None:
    """Train a byte-level BPE on ``texts`` and save it as a Hugging Face fast tokenizer.

    Special tokens get ids 0..6 in the order of ``SPECIAL_TOKENS``; bos is
    ``<|begin_of_text|>`` (prepended by the chat template only, not by plain encoding),
    eos is ``<|end|>`` and pad is ``<|pad|>``.
    """
    tok = _build_tokenizer_model(texts, vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))

    special_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": END_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [EOT_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN],
    }
    added_tokens_decoder = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": END_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": special_map["additional_special_tokens"],
        "added_tokens_decoder": added_tokens_decoder,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "right",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n", encoding="utf-8")
