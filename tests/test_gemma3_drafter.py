"""An EAGLE-3.1 drafter for a Gemma 3 target: the training recipe builds its config (Gemma 3 270M's
sizes, a 32k draft vocabulary) and starts it from the target, whose (1 + w) final norm becomes the
drafter's plain RMSNorm weight 1 + w. The bundled drafter (assets/gemma3/drafter-eagle3.1) is an EAGLE-layout
checkpoint of at most 16 MB; where Gemma 3 270M is cached (eagle-jax-fetch gemma-3-270m), greedy speculation with
it returns the target's own tokens and accepts drafts."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import eagle_jax
from eagle_jax import Drafter
from eagle_jax.checkpoint.models import model_path
from eagle_jax.config import FULL_LAYER, SLIDING_LAYER, RopeConfig, SpecConfig, TargetConfig, check_pair
from eagle_jax.training.recipe import build_target, drafter_config_for, load_config, merge_config, warm_start

GEMMA3_270M = TargetConfig(
    architecture="gemma3",
    vocab_size=262144,
    hidden_size=640,
    intermediate_size=2048,
    num_layers=18,
    num_heads=4,
    num_kv_heads=1,
    head_dim=256,
    rope=RopeConfig(theta=1e6),
    local_rope=RopeConfig(theta=1e4),
    sliding_window=512,
    layer_types=tuple(SLIDING_LAYER if (i + 1) % 6 else FULL_LAYER for i in range(18)),
    norm_unit_offset=True,
    sandwich_norms=True,
    scale_embeddings=True,
    hidden_act="gelu_pytorch_tanh",
    query_pre_attn_scalar=256.0,
    qk_norm=True,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
)
EAGLE31 = {"drafter": {"draft_vocab_size": 32768, "fc_norm": True, "norm_output": True}}


def test_eagle31_drafter_config_for_gemma3_270m():
    cfg = merge_config(load_config(), EAGLE31)
    target = SimpleNamespace(config=GEMMA3_270M)  # the recipe reads only the target's config here
    dc = drafter_config_for(cfg, target)
    assert check_pair(GEMMA3_270M, dc) == (2, 9, 15)
    assert (dc.hidden_size, dc.target_hidden_size, dc.draft_vocab_size, dc.vocab_size) == (640, 640, 32768, 262144)
    assert dc.fc_norm and dc.norm_output and dc.num_aux_hidden_states == 3
    drafter = nnx.eval_shape(lambda: Drafter(dc, jnp.zeros((262144, 640))))  # shapes only: no 671 MB of weights
    assert drafter.fc.kernel.shape == (3 * 640, 640) and drafter.lm_head.kernel.shape == (640, 32768)
    assert drafter.self_attn.q_proj.kernel.shape == (2 * 640, 4 * 256)


def test_warm_started_norm_scales_as_the_targets():
    random = dict(
        architecture="gemma3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        sliding_window=4,
        layer_types=[SLIDING_LAYER, FULL_LAYER],
        local_rope={"theta": 100.0},
        norm_unit_offset=True,
        sandwich_norms=True,
        scale_embeddings=True,
        hidden_act="gelu_pytorch_tanh",
        qk_norm=True,
        tie_word_embeddings=True,
    )
    cfg = merge_config(load_config(), {"target": {"random": random}, **EAGLE31, "drafter": {"draft_vocab_size": 16}})
    target = build_target(cfg)
    target.norm.weight.set_value(jnp.linspace(-0.5, 0.5, 32))
    drafter = Drafter(drafter_config_for(cfg, target), target.embed_tokens[...])
    warm_start(drafter, target, ["norm"])
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 32)), jnp.float32)
    np.testing.assert_allclose(np.asarray(drafter.norm(x)), np.asarray(target.norm(x)), rtol=1e-6)


def test_the_gemma3_recipe_makes_a_drafter_that_fits_the_bundle():
    """configs/train/gemma3_270m.yaml: an EAGLE-3.1 drafter of Gemma 3 270M whose trained weights stay under 16 MB in
    bfloat16 (the frozen target embedding is not part of a drafter checkpoint)."""
    from pathlib import Path

    cfg = load_config(Path(__file__).parents[1] / "configs" / "train" / "gemma3_270m.yaml")
    dc = drafter_config_for(cfg, SimpleNamespace(config=GEMMA3_270M))
    assert dc.fc_norm and dc.norm_output and dc.draft_vocab_size < GEMMA3_270M.vocab_size
    drafter = nnx.eval_shape(lambda: Drafter(dc, jnp.zeros((262144, 640))))
    weights = nnx.state(drafter, nnx.Param)
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(weights))
    assert 2 * count <= 16 * 2**20, f"{count} parameters: {2 * count / 2**20:.1f} MB in bfloat16"


BUNDLED = Path(__file__).resolve().parents[1] / "assets" / "gemma3" / "drafter-eagle3.1"
GEMMA3 = model_path("gemma-3-270m")


def test_the_bundled_drafter_is_an_eagle_layout_checkpoint_of_at_most_16_mb():
    config = json.loads((BUNDLED / "config.json").read_text())
    tensors = load_file(str(BUNDLED / "model.safetensors"))
    assert (BUNDLED / "model.safetensors").stat().st_size <= 16 * 2**20
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["fc_norm"] and config["norm_output"]
    assert config["hidden_size"] == 640 and config["vocab_size"] == 262144
    assert tensors["fc.weight"].shape == (640, 3 * 640)
    assert tensors["lm_head.weight"].shape == (config["draft_vocab_size"], 640)
    assert str(tensors["fc.weight"].dtype) == "bfloat16" and "embed_tokens.weight" not in tensors


@pytest.mark.skipif(not GEMMA3.exists(), reason=f"Gemma 3 270M is not cached ({GEMMA3}): eagle-jax-fetch gemma-3-270m")
def test_greedy_speculation_with_the_real_gemma3_pair_is_the_targets_output():
    target = eagle_jax.load_target(GEMMA3, dtype="float32")
    tok = eagle_jax.load_tokenizer(GEMMA3)
    ids = tok.encode("The history of the printing press begins")  # with the tokenizer's <bos>, as the data
    plain = eagle_jax.generate(target, None, [ids], max_new_tokens=24, tokenizer=tok)
    drafter = eagle_jax.load_drafter(BUNDLED, target, dtype="float32")
    out = eagle_jax.generate(
        target, drafter, [ids], max_new_tokens=24, tokenizer=tok, spec=SpecConfig(num_speculative_tokens=3)
    )
    assert out.tokens[0] == plain.tokens[0]
    assert out.acceptance_length > 1.05, out.acceptance_length
