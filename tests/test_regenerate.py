"""Regeneration: assistant turns replaced by the target's own greedy replies, turn by turn."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from transformers import AutoTokenizer

from eagle_jax import Target, TargetConfig, save_target
from eagle_jax.training.data import load_samples
from workshop.tokenizer_build import train_tokenizer

CORPUS = ["def add(a, b):\n    return a + b\n" * 10, "Hello there, how are you? Fine, thanks.\n" * 10]


def greedy(target: Target, ids: list[int], n: int, eos: int, width: int = 128) -> list[int]:
    """Reference: the target's own greedy decoding by full (causal, right-padded) forwards, stopping after EOS."""
    forward = jax.jit(lambda x: target(x)[0])
    out = list(ids)
    for _ in range(n):
        logits = forward(jnp.asarray([out + [0] * (width - len(out))], jnp.int32))
        out.append(int(np.argmax(np.asarray(logits[0, len(out) - 1]))))
        if out[-1] == eos:
            break
    return out[len(ids):]


def test_regenerate_cli_replaces_assistant_turns_in_order(tmp_path):
    from eagle_jax.cli.regenerate import main

    train_tokenizer(CORPUS, vocab_size=300, out_dir=tmp_path / "target")
    tok = AutoTokenizer.from_pretrained(tmp_path / "target")
    cfg = TargetConfig("llama", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, max_position_embeddings=256)
    target = Target(cfg)
    target.lm_head.kernel.set_value(target.lm_head.kernel[...] * 8.0)  # peaked, varied replies
    save_target(target, tmp_path / "target")
    convs = [
        {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "OLD1"},
                      {"role": "user", "content": "and add?"}, {"role": "assistant", "content": "OLD2"}]},
        {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "def"}, {"from": "gpt", "value": "OLD3"}]},
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(c) for c in convs) + "\n")
    main(["--target", str(tmp_path / "target"), "--data", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out.jsonl"),
          "--max-new-tokens", "6", "--batch-size", "2"])
    out = [json.loads(line)["messages"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [[m["role"] for m in c] for c in out] == [["user", "assistant", "user", "assistant"], ["system", "user", "assistant"]]
    assert out[0][2]["content"] == "and add?" and out[1][1]["content"] == "def"
    # Each reply is the target's greedy continuation of the conversation so far, earlier replies regenerated.
    for conv in out:
        for i, m in enumerate(conv):
            if m["role"] != "assistant":
                continue
            prompt = tok.apply_chat_template(conv[:i], tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
            want = tok.decode(greedy(target, list(prompt), 6, tok.eos_token_id), skip_special_tokens=True)
            assert m["content"] == want and "OLD" not in m["content"]
    samples, stats = load_samples(tmp_path / "out.jsonl", tok, 512, progress=False)
    assert stats.kept + stats.no_loss == 2
