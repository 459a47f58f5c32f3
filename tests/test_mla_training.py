"""TTT training of an MLA EAGLE-3.1 drafter on a random DeepSeek-V3-style target (configs/train/tiny_mla_moe.yaml,
shortened), its export and reload, and the Kimi-K2 recipe (configs/train/kimi_k2_mla.yaml) validated
against Kimi-K2's published sizes without running it.

The short run is deterministic (seeded data, init and order; one CPU device), so its thresholds are
fixed numbers, well inside the measured values: the loss of the last 5 steps is 0.75x that of the
first 5 (asserted < 0.85x); the reloaded drafter has 54 drafts accepted over 16 held-out prompts at
chain K=3 (asserted >= 10; an untrained one is right about once in Vd = 256 rounds).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import eagle_jax
from eagle_jax import Drafter, SpecConfig, Target, TargetConfig
from eagle_jax.config import check_pair
from eagle_jax.training.trainer import (
    TrainConfigError,
    build_target,
    drafter_config_for,
    load_config,
    mesh_from_config,
    train,
    train_flops_per_token,
)

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "train" / "tiny_mla_moe.yaml"
KIMI = REPO / "configs" / "train" / "kimi_k2_mla.yaml"
SHORT = [
    "train.steps=60",
    "train.ttt_length=3",
    "data.synthetic={num_samples: 256, prompt_length: 8}",
    "data.max_length=48",
    "checkpoint.every=0",
    "log.every=1",
    "log.progress=false",
]

# Kimi-K2-Instruct's config.json (the fields the loader reads).
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.827,
    "norm_topk_prob": True,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("mla_training") / "run"
    cfg = load_config(TINY, SHORT + [f"run_dir={run_dir}"])
    return cfg, train(cfg)


def test_mla_drafter_trains_exports_and_drafts(run):
    cfg, summary = run
    losses = np.array([r["loss"] for r in summary["records"]])
    assert len(losses) == 60
    assert losses[-5:].mean() < 0.85 * losses[:5].mean(), f"loss {losses[:5].mean():.3f} -> {losses[-5:].mean():.3f}"

    export = Path(summary["export_dir"])
    hf = json.loads((export / "config.json").read_text())
    assert (
        hf["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
        and hf["kv_lora_rank"] == 32
        and hf["fc_norm"]
        and hf["norm_output"]
    )
    target = build_target(cfg)  # the same seeded target
    assert target.config.architecture == "deepseek_v3"
    drafter = eagle_jax.load_drafter(export, target)
    dc = drafter.config
    assert dc.mla == target.config.mla and dc.rope == target.config.rope and dc.draft_vocab_size == 256

    rng = np.random.default_rng(12345)  # held out: the training prompts come from seed 0
    prompts = [list(map(int, rng.integers(0, 512, 8))) for _ in range(16)]
    plain = eagle_jax.generate(target, None, prompts, max_new_tokens=40, eos_token_id=[])
    out = eagle_jax.generate(
        target, drafter, prompts, max_new_tokens=40, spec=SpecConfig(num_speculative_tokens=3), eos_token_id=[]
    )
    assert out.tokens == plain.tokens
    accepted = sum(a for row in out.accepted for a in row)
    assert accepted >= 10, f"{accepted} drafts accepted (AL {out.acceptance_length:.3f})"


def test_drafter_attention_follows_the_target_or_the_config(run):
    cfg, _ = run
    target = build_target(cfg)
    mla = drafter_config_for(cfg, target)
    assert mla.mla == target.config.mla and (mla.num_kv_heads, mla.head_dim) == (4, 24)
    gqa = drafter_config_for(load_config(TINY, SHORT + ["drafter.attention=gqa"]), target)
    assert gqa.mla is None and gqa.rope.type == "default" and gqa.architectures == ("LlamaForCausalLMEagle3",)
    with pytest.raises(TrainConfigError, match="drafter.attention=mla needs an MLA target"):
        drafter_config_for(
            load_config(TINY, ["drafter.attention=mla"]),
            Target(
                TargetConfig(
                    "llama",
                    vocab_size=64,
                    hidden_size=32,
                    intermediate_size=64,
                    num_layers=3,
                    num_heads=4,
                    num_kv_heads=2,
                    head_dim=8,
                )
            ),
        )
    with pytest.raises(TrainConfigError, match="drafter.num_kv_heads / drafter.head_dim"):
        drafter_config_for(load_config(TINY, ["drafter.num_kv_heads=2"]), target)
    with pytest.raises(TrainConfigError, match="target.random: .*moe"):
        build_target(
            load_config(
                TINY,
                [
                    "target.random={architecture: deepseek_v3, vocab_size: 64, hidden_size: 32, "
                    "intermediate_size: 64, num_layers: 2, num_heads: 4, "
                    "mla: {q_lora_rank: null, kv_lora_rank: 8, qk_nope_head_dim: 8, qk_rope_head_dim: 4, v_head_dim: "
                    "8}}"
                ],
            )
        )


def test_kimi_k2_recipe_validates():
    """The recipe loads, its mesh is data x fsdp x expert x model, and the drafter it builds for Kimi-K2
    (an abstract target: no weights) has the released drafter's sizes and reads layers (2, 30, 58)."""
    cfg = load_config(KIMI)
    m = cfg["mesh"]
    assert (m["data"], m["fsdp"], m["expert"], m["model"]) == (1, 2, 8, 8)
    shards = m["data"] * m["fsdp"]
    assert cfg["train"]["batch_size"] % (cfg["train"]["grad_accum"] * shards) == 0
    with pytest.raises(TrainConfigError, match="needs 128 devices"):
        mesh_from_config(m)  # this machine has fewer

    target = nnx.eval_shape(lambda: Target(TargetConfig.from_hf(KIMI_K2, "Kimi-K2 config.json"), dtype=jnp.bfloat16))
    dc = drafter_config_for(cfg, target)
    assert check_pair(target.config, dc, "kimi_k2_mla.yaml") == (2, 30, 58)
    assert (dc.hidden_size, dc.num_heads, dc.intermediate_size, dc.draft_vocab_size) == (7168, 64, 18432, 163840)
    assert (
        dc.mla.q_lora_rank,
        dc.mla.kv_lora_rank,
        dc.mla.qk_nope_head_dim,
        dc.mla.qk_rope_head_dim,
        dc.mla.v_head_dim,
    ) == (1536, 512, 128, 64, 128)
    assert (dc.rope.type, dc.rope.theta, dc.rope.factor, dc.rms_norm_eps, dc.fc_norm, dc.norm_output) == (
        "yarn",
        50000.0,
        32.0,
        1e-5,
        True,
        True,
    )
    assert dc.to_hf()["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    drafter = nnx.eval_shape(lambda: Drafter(dc))
    trainable = sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(nnx.state(drafter, nnx.Param)))
    assert 1.8e9 < trainable < 1.9e9  # + the frozen 1.17 B embedding = the released drafter's ~3.0 B

    # FLOPs count the activated experts (8 of 384) + the shared one: ~32 B weights per token, as Kimi-K2's card says.
    flops = train_flops_per_token(target, drafter, 4096, 7)
    assert 1.3e11 < flops < 1.6e11, flops
