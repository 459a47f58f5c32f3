"""DeepSeek-V3 / Kimi-K2 targets (MLA + MoE): ``eagle_jax.load_target`` against HF transformers'
``DeepseekV3ForCausalLM`` on the same tiny random checkpoints.

Error norm everywhere: ``rel_err`` = max|jax - hf| / max|hf| (max-abs relative error, conftest).
Tolerance: fp32 <= 1e-5 (measured ~1e-6: the same math in another summation order; the cached path
computes attention in the absorbed form, W_UK folded into the query, which only reorders sums).
Routing is discrete, so these numbers also say that every token picked the same experts: one
different choice would move the layer's output by O(1).

The random checkpoints (``randomize_``) get a selection bias ``e_score_correction_bias`` of N(0, 0.5)
(HF leaves it zero), large enough against sigmoid scores in (0, 1) to change which experts win;
``test_router_matches_hf`` checks that it does.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

import eagle_jax
from eagle_jax.config import TargetConfig
from eagle_jax.modeling.mla import expanded_cache_bytes_per_token, latent_cache_bytes_per_token
from eagle_jax.modeling.moe import Router
from eagle_jax.modeling.target import KVCache, window_mask
from parity_tests.conftest import hf_forward, randomize_, rel_err
from parity_tests.test_target_parity import cached_decode

FP32_TOL = 1e-5
BATCH, SEQ, VOCAB = 2, 24, 128

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,  # != qk head dim 24: value and key heads differ in width
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
# Sequences (SEQ=24) are longer than original_max_position_embeddings (16), so YaRN's ramp matters.
CASES = {
    # q_a_proj -> q_a_layernorm -> q_b_proj; one dense layer then MoE; 2 groups of 4 experts, 1 kept per
    # token; a shared expert; YaRN with mscale != mscale_all_dim (cos/sin and softmax scale both != 1).
    "q_lora_groups_yarn": dict(
        q_lora_rank=48,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=16,
            mscale=1.0,
            mscale_all_dim=0.8,
            beta_fast=32.0,
            beta_slow=1.0,
        ),
    ),
    # direct q_proj; every layer MoE; 2 shared experts (one MLP of 2 * moe_intermediate_size); weights not
    # normalised; 4 groups of 2, 3 kept, top-3; rotate-half rope layout; plain RoPE; a large rms_norm_eps,
    # which HF's latent norms (eps 1e-6) do not use; attention_bias (on kv_a_proj_with_mqa and o_proj).
    "direct_q": dict(
        q_lora_rank=None,
        rms_norm_eps=0.05,
        attention_bias=True,
        n_group=4,
        topk_group=3,
        num_experts_per_tok=3,
        n_shared_experts=2,
        first_k_dense_replace=0,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
        rope_interleave=False,
    ),
    # Kimi-K2's shape: one group, 2 dense layers of 4, YaRN with mscale == mscale_all_dim and
    # beta_fast = beta_slow = 1, theta 50000; a large rms_norm_eps (not q_a_layernorm's).
    "kimi_k2_like": dict(
        q_lora_rank=48,
        rms_norm_eps=0.05,
        num_hidden_layers=4,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=2,
        routed_scaling_factor=2.827,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=50000.0,
            factor=32.0,
            original_max_position_embeddings=16,
            mscale=1.0,
            mscale_all_dim=1.0,
            beta_fast=1.0,
            beta_slow=1.0,
        ),
    ),
}


def build_hf_deepseek(case: str, seed: int = 0, **overrides) -> DeepseekV3ForCausalLM:
    """A tiny random DeepseekV3ForCausalLM (eager attention, eval mode) with a random selection bias."""
    config = DeepseekV3Config(**{**BASE, **CASES[case], **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config)
    randomize_(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.5 * torch.randn(buf.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """``get(case, fmt="safetensors") -> (path, HF model as from_pretrained reloads it)``, built once.

    fmt "safetensors": ``save_pretrained`` (one tensor per expert); "state_dict": ``torch.save`` of the
    model's state dict, which holds the experts fused (``experts.gate_up_proj`` [E, 2I, H]).
    """
    root = tmp_path_factory.mktemp("hf_deepseek")
    cache: dict = {}

    def get(case: str, fmt: str = "safetensors"):
        if (case, fmt) not in cache:
            model = build_hf_deepseek(case)
            path = root / f"{case}_{fmt}"
            model.save_pretrained(path)
            if fmt == "state_dict":
                for f in path.glob("*.safetensors"):
                    f.unlink()
                torch.save(
                    {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
                    path / "pytorch_model.bin",
                )
            reloaded = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
            cache[(case, fmt)] = (path, reloaded)
        return cache[(case, fmt)]

    return get


@pytest.fixture(scope="module")
def input_ids() -> np.ndarray:
    return np.random.default_rng(1234).integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)


def check_logits(target, hf_model, ids, record, device="cpu") -> None:
    """Logits and every residual stream entering a layer (HF hidden_states[i], i < L)."""
    num_layers, hidden = target.config.num_layers, target.config.hidden_size
    hf_logits, hf_hidden = hf_forward(hf_model, ids, device)
    logits, aux = target(jnp.asarray(ids), tuple(range(num_layers)))
    errs = {}
    for i in range(num_layers):
        errs[f"hidden_states[{i}]"] = record(
            f"hidden_states[{i}]", rel_err(aux[..., i * hidden : (i + 1) * hidden], hf_hidden[i])
        )
    errs["logits"] = record("logits", rel_err(logits, hf_logits))
    bad = {k: v for k, v in errs.items() if v > FP32_TOL}
    assert not bad, f"differ from HF: {bad}"


# ----------------------------------------------------------------------------------------- forward


@pytest.mark.parametrize("case", list(CASES))
def test_deepseek_parity_fp32(case, device, hf_models, input_ids, record_error):
    path, hf_model = hf_models(case)
    target = eagle_jax.load_target(path)
    c, want = target.config, CASES[case]
    assert (c.architecture, target.dtype) == ("deepseek_v3", jnp.float32)
    assert c.mla.q_lora_rank == want["q_lora_rank"] and c.mla.rope_interleave == want.get("rope_interleave", True)
    routing = (c.moe.n_group, c.moe.topk_group, c.moe.first_k_dense_replace)
    assert routing == (want["n_group"], want["topk_group"], want["first_k_dense_replace"])
    assert c.rope.type == want.get("rope_parameters", {}).get("rope_type", "default")
    kinds = [type(layer.mlp).__name__ for layer in target.layers]
    assert kinds == ["MLP"] * want["first_k_dense_replace"] + ["MoE"] * (c.num_layers - want["first_k_dense_replace"])
    check_logits(target, hf_model, input_ids, record_error, device)


def test_router_matches_hf(hf_models, record_error):
    """The router alone on 512 random hidden states: same experts (as sets) and weights; the selection
    bias and the group limit each change some choices, so both are exercised."""
    _, hf_model = hf_models("q_lora_groups_yarn")
    hf_gate = hf_model.model.layers[1].mlp.gate
    x = torch.randn(512, BASE["hidden_size"], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, hf_w, hf_idx = hf_gate(x)
    config = TargetConfig.from_hf(hf_model.config.to_dict())
    router = Router(BASE["hidden_size"], config.moe, dtype=jnp.float32, rngs=nnx.Rngs(0))
    router.weight.set_value(jnp.asarray(hf_gate.weight.detach().numpy()))
    router.e_score_correction_bias.set_value(jnp.asarray(hf_gate.e_score_correction_bias.numpy()))
    w, idx = router(jnp.asarray(x.numpy()))
    order_hf, order = np.argsort(hf_idx.numpy(), axis=1), np.argsort(np.asarray(idx), axis=1)
    assert np.array_equal(
        np.take_along_axis(hf_idx.numpy(), order_hf, 1), np.take_along_axis(np.asarray(idx), order, 1)
    )
    got_w, want_w = np.take_along_axis(np.asarray(w), order, 1), np.take_along_axis(hf_w.numpy(), order_hf, 1)
    assert record_error("weights", rel_err(got_w, want_w)) <= 1e-6

    def top(bias: bool, groups: bool) -> np.ndarray:
        cfg = dataclasses.replace(config.moe, topk_group=1 if groups else config.moe.n_group)
        r = Router(BASE["hidden_size"], cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
        r.weight.set_value(router.weight[...])
        r.e_score_correction_bias.set_value(router.e_score_correction_bias[...] if bias else jnp.zeros(8))
        return np.sort(np.asarray(r(jnp.asarray(x.numpy()))[1]), axis=1)

    full = top(True, True)
    assert (full != top(False, True)).any(axis=1).mean() > 0.1  # the bias matters
    assert (full != top(True, False)).any(axis=1).mean() > 0.1  # the group limit matters


# ---------------------------------------------------------------------------------- cached decoding


def prefill_then_decode(target, ids: np.ndarray, lengths, cache_len: int, block: int = 3, singles: int = 4):
    """The engine's order: the prompt block attends only to itself ([B, P, P] mask, expanded form) while
    filling a larger latent cache, then a block and single tokens at per-row write indices over the
    whole cache (absorbed form). Returns {phase: (logits [n, V], [(row, position), ...])}."""
    b = ids.shape[0]
    lengths = np.asarray(lengths, np.int32)
    p = int(lengths.max())
    cache = target.init_cache(b, cache_len)
    prompt = ids[:, :p].copy()
    for r in range(b):  # past a row's length: tokens that differ from its continuation, overwritten later
        prompt[r, lengths[r] :] = (ids[r, lengths[r] : p] + 1) % VOCAB
    pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    hidden, _, cache = target.forward(
        jnp.asarray(prompt), pos, window_mask(pos, pos, None), cache, jnp.zeros(b, jnp.int32)
    )
    logits = np.asarray(target.logits(hidden))
    where = [(r, t) for r in range(b) for t in range(lengths[r])]
    out = {"prefill": (np.stack([logits[r, t] for r, t in where]), where)}
    slots = jnp.broadcast_to(jnp.arange(cache_len, dtype=jnp.int32), (b, cache_len))
    cur = lengths.copy()
    steps = [("block", block)] + [("single", 1)] * singles
    got: dict[str, list] = {"block": [], "single": []}
    spots: dict[str, list] = {"block": [], "single": []}
    for phase, n in steps:
        tokens = np.stack([ids[r, cur[r] : cur[r] + n] for r in range(b)])
        qpos = jnp.asarray(cur[:, None] + np.arange(n, dtype=np.int32)[None, :])
        mask = window_mask(qpos, slots, None) & (slots < jnp.asarray(cur + n)[:, None])[:, None, :]
        hidden, _, cache = target.forward(jnp.asarray(tokens), qpos, mask, cache, jnp.asarray(cur))
        logits = np.asarray(target.logits(hidden))
        got[phase].extend(logits.reshape(b * n, -1))
        spots[phase].extend((r, int(cur[r]) + j) for r in range(b) for j in range(n))
        cur = cur + n
    out.update({k: (np.stack(got[k]), spots[k]) for k in got})
    return out


class JittedTarget:
    """The target's ``forward`` / ``logits`` compiled once per shape (a handful of programs instead of
    hundreds of eagerly dispatched ops), with its ``config`` and ``init_cache``."""

    def __init__(self, target):
        graph, self.state = nnx.split(target)
        self.config, self.init_cache = target.config, target.init_cache
        self._forward = jax.jit(lambda state, *args: nnx.merge(graph, state).forward(*args))
        self._logits = jax.jit(lambda state, hidden: nnx.merge(graph, state).logits(hidden))

    def forward(self, *args):
        return self._forward(self.state, *args)

    def logits(self, hidden):
        return self._logits(self.state, hidden)


@pytest.mark.parametrize("case", ["q_lora_groups_yarn", "direct_q"])
def test_cached_decoding(case, device, hf_models, input_ids, record_error):
    """Both prefill forms, then a 3-token block and single tokens at ragged per-row write indices, equal
    the full-sequence HF logits: ``cached_decode`` prefills over the whole cache (absorbed form), and
    ``prefill_then_decode`` prefills the block against itself into a larger cache (expanded form)."""
    path, hf_model = hf_models(case)
    hf_logits = hf_forward(hf_model, input_ids, device)[0].numpy()
    target = JittedTarget(eagle_jax.load_target(path))
    runs = {
        "absorbed": cached_decode(target, input_ids, (7, 11), block=3, singles=4),
        "expanded": prefill_then_decode(target, input_ids, (7, 11), cache_len=SEQ + 8),
    }
    for form, phases in runs.items():
        for phase, (got, where) in phases.items():
            want = np.stack([hf_logits[r, t] for r, t in where])
            err = record_error(f"{form}/{phase}", rel_err(got, want))
            assert err <= FP32_TOL, f"{form} {phase}: cached logits differ from the full-sequence logits ({err:.3e})"


def test_latent_cache_holds_latent_and_rope_key_only(hf_models):
    """Per token and layer the cache holds kv_lora_rank + qk_rope_head_dim numbers, not per-head K/V."""
    target = eagle_jax.load_target(hf_models("q_lora_groups_yarn")[0])
    b, s = 3, 40
    cache = target.init_cache(b, s)
    numbers = sum(x.size for x in jax.tree.leaves(cache)) / (b * s * target.config.num_layers)
    assert numbers == BASE["kv_lora_rank"] + BASE["qk_rope_head_dim"] == 40
    assert all(k.shape == (b, 1, s, 32) for k in cache.k) and all(v.shape == (b, 1, s, 8) for v in cache.v)
    per_head_kv = BASE["num_attention_heads"] * (
        BASE["qk_nope_head_dim"] + BASE["qk_rope_head_dim"] + BASE["v_head_dim"]
    )
    assert per_head_kv == 160  # what the same model would cache per token and layer without the latent


# Published config.json fields (the architecture's sizes only) of the two models the docstring table covers.
DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    topk_method="noaux_tc",
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    moe_layer_freq=1,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    scoring_func="sigmoid",
    num_nextn_predict_layers=1,
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    rope_theta=10000,
    rope_scaling={
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
)
KIMI_K2 = dict(
    DEEPSEEK_V3,
    model_type="kimi_k2",
    vocab_size=163840,
    num_attention_heads=64,
    num_key_value_heads=64,
    n_routed_experts=384,
    routed_scaling_factor=2.827,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    num_nextn_predict_layers=0,
    max_position_embeddings=131072,
    rope_theta=50000.0,
    rope_scaling={
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
)


@pytest.mark.parametrize(
    "name,raw,params,mla_bytes,mha_bytes",
    [
        ("DeepSeek-V3", DEEPSEEK_V3, 671_026_419_200, 70272, 4997120),
        ("Kimi-K2", KIMI_K2, 1_026_408_232_448, 70272, 2498560),
    ],
)
def test_full_size_configs(name, raw, params, mla_bytes, mha_bytes):
    """The published configs read as DeepSeek-V3 targets of the published sizes (671B parameters, the
    MTP module aside; Kimi-K2 1.03T: counted on an abstract model of the dense layers and one MoE
    layer, the other MoE layers being copies of it); a cached forward traces at full width; bf16 cache
    bytes per token as in mla.py's table."""
    c = TargetConfig.from_hf(raw, name)
    assert (c.architecture, c.num_heads, c.head_dim, c.rope_dim) == ("deepseek_v3", raw["num_attention_heads"], 192, 64)
    assert c.rope.type == "yarn"
    assert latent_cache_bytes_per_token(c) == mla_bytes == 61 * 576 * 2
    assert expanded_cache_bytes_per_token(c) == mha_bytes
    shapes = jax.eval_shape(lambda: KVCache.for_config(c, 1, 4096, jnp.bfloat16))
    assert sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes)) == 4096 * mla_bytes

    dense = c.moe.first_k_dense_replace
    short = c.replace(num_layers=dense + 1)
    graph, state = nnx.split(nnx.eval_shape(lambda: eagle_jax.Target(short, dtype=jnp.bfloat16)))
    count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
    moe_layer = count(state["layers"][dense])
    assert count(state) + (c.num_layers - dense - 1) * moe_layer == params

    def step(state, cache):
        ids = jnp.zeros((2, 4), jnp.int32)
        mask = jnp.ones((2, 4, 64), bool)
        return nnx.merge(graph, state).forward(ids, ids, mask, cache, jnp.zeros(2, jnp.int32), (0, dense))

    hidden, aux, cache = jax.eval_shape(
        step, state, jax.eval_shape(lambda: KVCache.for_config(short, 2, 64, jnp.bfloat16))
    )
    assert hidden.shape == (2, 4, 7168) and aux.shape == (2, 4, 2 * 7168) and cache.k[-1].shape == (2, 1, 64, 512)


# ------------------------------------------------------------------------------------ greedy decoding


def test_greedy_generate_equals_hf(hf_models):
    """``eagle_jax.generate(target, None, ...)`` on a ragged batch = HF greedy ``generate`` of each
    prompt alone (its own cached decoding), token for token."""
    path, hf_model = hf_models("q_lora_groups_yarn")
    target = eagle_jax.load_target(path)
    prompts = [[5, 17, 99, 3, 42, 8, 61], [77, 12, 9]]
    new = 16
    out = eagle_jax.generate(target, None, prompts, max_new_tokens=new, eos_token_id=[])
    hf_model.generation_config.eos_token_id = None
    for prompt, got in zip(prompts, out.tokens):
        with torch.no_grad():
            want = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)[
                0, len(prompt) :
            ].tolist()
        assert got == want


# -------------------------------------------------------------------------------- checkpoint formats


def _safetensors_header(file: Path) -> dict:
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_save_target_round_trip(hf_models, input_ids, record_error, tmp_path):
    """load_target -> save_target -> transformers from_pretrained gives the original HF logits; the file
    holds one tensor per expert (what transformers writes) and the selection bias in fp32 even in bf16."""
    path, hf_model = hf_models("q_lora_groups_yarn")
    target = eagle_jax.load_target(path)
    out = tmp_path / "saved"
    eagle_jax.save_target(target, out)
    keys = set(_safetensors_header(out / "model.safetensors")) - {"__metadata__"}
    assert keys == set(_safetensors_header(path / "model.safetensors")) - {"__metadata__"}
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(reloaded) is DeepseekV3ForCausalLM
    a, b = reloaded.config, hf_model.config
    fields = (
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "n_group",
        "topk_group",
        "first_k_dense_replace",
        "n_shared_experts",
        "routed_scaling_factor",
        "norm_topk_prob",
        "rope_interleave",
    )
    assert {f: getattr(a, f) for f in fields} == {f: getattr(b, f) for f in fields}
    assert a.rope_parameters == b.rope_parameters
    want, _ = hf_forward(hf_model, input_ids)
    got, _ = hf_forward(reloaded, input_ids)
    assert record_error("logits", rel_err(got, want)) <= 1e-6
    eagle_jax.save_target(target, tmp_path / "bf16", dtype="bfloat16")
    header = _safetensors_header(tmp_path / "bf16" / "model.safetensors")
    assert header["model.layers.1.mlp.gate.e_score_correction_bias"]["dtype"] == "F32"
    assert header["model.layers.1.mlp.experts.7.down_proj.weight"]["dtype"] == "BF16"


def test_fused_expert_state_dict(hf_models, input_ids, record_error):
    """A state dict saved straight from the transformers model (experts fused as gate_up_proj /
    down_proj [E, ...]) loads to the same logits."""
    path, hf_model = hf_models("direct_q", fmt="state_dict")
    stored = torch.load(path / "pytorch_model.bin", weights_only=True)
    assert (
        "model.layers.0.mlp.experts.gate_up_proj" in stored
        and "model.layers.0.mlp.experts.0.up_proj.weight" not in stored
    )
    hf_logits, _ = hf_forward(hf_model, input_ids)
    logits, _ = eagle_jax.load_target(path)(jnp.asarray(input_ids))
    assert record_error("logits", rel_err(logits, hf_logits)) <= FP32_TOL


def test_kimi_k2_config_json(hf_models, input_ids, record_error, tmp_path):
    """Kimi-K2's config.json dialect (model_type kimi_k2, transformers-4 rope_theta + rope_scaling with
    'type', torch_dtype, its own auto_map) over the same weights gives the same logits."""
    path, hf_model = hf_models("kimi_k2_like")
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.update(
        model_type="kimi_k2",
        rope_theta=rope.pop("rope_theta"),
        rope_scaling={**{k: v for k, v in rope.items() if k != "rope_type"}, "type": rope["rope_type"]},
        torch_dtype=cfg.pop("dtype"),
        auto_map={
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
        },
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        num_nextn_predict_layers=0,
    )
    kimi = tmp_path / "kimi"
    kimi.mkdir()
    (kimi / "config.json").write_text(json.dumps(cfg))
    (kimi / "model.safetensors").symlink_to(path / "model.safetensors")
    a, b = TargetConfig.from_pretrained(kimi), TargetConfig.from_pretrained(path)
    assert a == b and a.moe.n_group == 1 and a.rope.theta == 50000.0
    hf_logits, _ = hf_forward(hf_model, input_ids)
    logits, _ = eagle_jax.load_target(kimi)(jnp.asarray(input_ids))
    assert record_error("logits", rel_err(logits, hf_logits)) <= FP32_TOL
