"""The EAGLE-3 and EAGLE-3.1 drafters shipped for SmolLM2-135M-Instruct (assets/smollm2/drafter-*).

Always: each is an EAGLE-layout checkpoint that a PyTorch engine loads (config fields, tensor names,
bf16, at most 25 MB), the two differ only in the 3.1 switches, and they share the draft vocabulary.
Where the real model is cached (eagle-jax-fetch smollm2-135m-instruct): both load against it and,
greedy, speculative decoding of a chat prompt returns the target's own tokens and accepts drafts.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import eagle_jax
from eagle_jax.checkpoint.models import model_path

ROOT = Path(__file__).resolve().parents[1] / "assets" / "smollm2"
DRAFTERS = {"eagle3": ROOT / "drafter-eagle3", "eagle3.1": ROOT / "drafter-eagle3.1"}
SMOLLM2 = model_path("smollm2-135m-instruct")


def test_checkpoints_are_the_eagle_layout():
    configs = {name: json.loads((d / "config.json").read_text()) for name, d in DRAFTERS.items()}
    tensors = {name: load_file(str(d / "model.safetensors")) for name, d in DRAFTERS.items()}
    for name, d in DRAFTERS.items():
        c, t = configs[name], tensors[name]
        assert (d / "model.safetensors").stat().st_size <= 25e6
        assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["hidden_size"] == 576 and c["vocab_size"] == 49152
        assert t["fc.weight"].shape == (576, 3 * 576) and t["lm_head.weight"].shape == (c["draft_vocab_size"], 576)
        assert t["midlayer.self_attn.q_proj.weight"].shape == (9 * 64, 2 * 576)
        assert str(t["fc.weight"].dtype) == "bfloat16" and "embed_tokens.weight" not in t
        assert (c["fc_norm"], c["norm_output"]) == ((True, True) if name == "eagle3.1" else (False, False))
        assert ("fc_norm.0.weight" in t) == (name == "eagle3.1")
    # Both read the same target layers; each maps its own draft vocabulary into the target's.
    assert configs["eagle3"]["eagle_config"] == configs["eagle3.1"]["eagle_config"]
    for t in tensors.values():
        targets = np.arange(len(t["d2t"])) + t["d2t"]
        assert len(np.unique(targets)) == len(targets) and targets.max() < 49152
    assert not np.array_equal(tensors["eagle3"]["fc.weight"], tensors["eagle3.1"]["fc.weight"])


@pytest.mark.skipif(
    not SMOLLM2.exists(),
    reason=f"SmolLM2-135M-Instruct is not cached ({SMOLLM2}): eagle-jax-fetch smollm2-135m-instruct",
)
def test_greedy_speculation_with_the_real_pair_is_the_targets_output():
    target = eagle_jax.load_target(SMOLLM2, dtype="float32")
    tok = eagle_jax.load_tokenizer(SMOLLM2)
    chat = [{"role": "user", "content": "Give me three tips for staying focused while studying."}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    plain = eagle_jax.generate(target, None, [list(ids)], max_new_tokens=32, tokenizer=tok)
    for d in DRAFTERS.values():
        drafter = eagle_jax.load_drafter(d, target, dtype="float32")
        out = eagle_jax.generate(
            target,
            drafter,
            [list(ids)],
            max_new_tokens=32,
            tokenizer=tok,
            spec={"method": "eagle3", "num_speculative_tokens": 3},
        )
        assert out.tokens[0] == plain.tokens[0]
        assert out.acceptance_length > 1.05, (d.name, out.acceptance_length)  # measured 1.19 (EAGLE-3), K=3
