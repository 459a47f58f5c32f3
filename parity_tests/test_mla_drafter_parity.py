"""The MLA EAGLE-3 / 3.1 drafter (DeepSeek-V3 / Kimi-K2 drafters) against the independent PyTorch
reference (parity_tests/torch_reference.py, its MLA attention written after HF transformers'
DeepseekV3Attention).

Each case builds a reference MLA drafter with random weights (norm weights included), writes it as a
drafter checkpoint in one of the published layouts, loads it through ``eagle_jax.load_drafter`` for a
tiny HF DeepSeek-V3 target loaded with ``eagle_jax.load_target``, and compares on identical inputs:

- the full-sequence call ``drafter(aux, ids)`` (expanded MLA, no cache) vs ``ref.forward``;
- cached decoding through the latent cache of ``drafter.init_cache``: a prefill block attending to
  itself (expanded form, written into the cache), a block of STEPS target-feature pairs over the cache
  (absorbed form, several queries), then CHAIN single steps each fed its model's OWN next feature
  (absorbed, the chain drafting pattern), vs the reference's growing per-head K/V; and the cache
  contents (normed latents, rotated shared rope keys) vs the reference's;
- round trip: ``save_drafter`` -> config.json read by the reference, safetensors strictly loaded into
  a fresh reference -> the same outputs; and ``load_drafter`` of its own output -> bit-identical.

Cases cover q LoRA and a direct q_proj, YaRN with mscale != mscale_all_dim and Kimi's YaRN (theta
50000, beta 1/1, mscale == mscale_all_dim), plain RoPE, EAGLE-3 and each EAGLE-3.1 flag, Vd < V with
d2t/t2d, the ``layers.0.*`` + ``model.`` layout with ``embed_tokens`` (TorchSpec's vLLM export) and
``midlayer.*``, and every MLA architecture name.

Error measure: conftest.rel_err = max|jax - ref| / max|ref|; fp32 <= 1e-5 (measured ~1e-7: the same
math in another summation order; the absorbed form folds kv_b_proj into the query, which only
reorders sums). Devices: conftest's ``device`` fixture (cpu; cuda when torch and JAX see a GPU).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import eagle_jax
from parity_tests.conftest import hf_forward, rel_err
from parity_tests.test_deepseek_parity import build_hf_deepseek
from parity_tests.test_drafter_parity import dev, host, np32, slot_mask, write_checkpoint
from parity_tests.torch_reference import RefDrafter, RefDrafterConfig, load_eagle_state_dict

V, H = 128, 64  # the target's (test_deepseek_parity.BASE); the drafter has the same width
B, T, STEPS, CHAIN = 2, 8, 3, 3
TARGET_AUX = (0, 1, 2)  # eagle_jax's default for the 3-layer target
TOL = 1e-5

YARN = dict(
    type="yarn",
    factor=4.0,
    original_max_position_embeddings=6,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=0.8,
)
KIMI_YARN = dict(
    type="yarn",
    factor=64.0,
    original_max_position_embeddings=4,
    beta_fast=1.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)

BASE_CONFIG = {
    "architectures": ["Eagle3DeepseekV2ForCausalLM"],
    "model_type": "kimi_k2",
    "hidden_size": H,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,  # != qk head dim 24 and != H / heads
    "intermediate_size": 96,
    "num_hidden_layers": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,  # the latent norms use it too
    "vocab_size": V,
    "draft_vocab_size": V,
    "rope_theta": 10000.0,
    "rope_scaling": YARN,
    "torch_dtype": "float32",
}


@dataclass(frozen=True)
class Case:
    config: dict = field(default_factory=dict)  # overrides of BASE_CONFIG
    own_embed: bool = False  # the checkpoint carries embed_tokens.weight (the target's, as TorchSpec exports it)
    alt_keys: bool = False  # `model.` prefix, `layers.0.*`, `draft_id_to_target_id`, no t2d
    keep_identity_map: bool = False  # write d2t/t2d even when Vd == V
    file: str = "model.safetensors"

    def config_json(self) -> dict:
        return {**BASE_CONFIG, **self.config}


CASES = {
    # EAGLE-3: q LoRA, YaRN with mscale != mscale_all_dim (cos/sin and softmax scale both scaled).
    "eagle3_q_lora_yarn": Case(keep_identity_map=True),
    # Kimi-K2.x EAGLE-3.1 as TorchSpec exports it for vLLM: layers.0.*, model. prefix, embed_tokens,
    # no d2t/t2d (Vd == V), theta 50000, Kimi's YaRN.
    "eagle31_kimi_layout": Case(
        config={"fc_norm": True, "norm_output": True, "rope_theta": 50000.0, "rope_scaling": KIMI_YARN},
        own_embed=True,
        alt_keys=True,
    ),
    # SpecForge's name; direct q_proj; plain RoPE; fc_norm only; Vd < V with d2t/t2d.
    "fc_norm_direct_q_vocab_map": Case(
        config={
            "architectures": ["DeepseekV3ForCausalLMEagle3"],
            "q_lora_rank": None,
            "rope_scaling": None,
            "fc_norm": True,
            "draft_vocab_size": 80,
        },
    ),
    # vLLM's V3 alias; norm_output only; model_type deepseek_v3; a large rms_norm_eps (the latent norms use it).
    "norm_output": Case(
        config={
            "architectures": ["Eagle3DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "norm_output": True,
            "rms_norm_eps": 0.05,
        }
    ),
}


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    """A tiny random HF DeepseekV3ForCausalLM (test_deepseek_parity's q-LoRA/YaRN case) on disk."""
    model = build_hf_deepseek("q_lora_groups_yarn")
    path = tmp_path_factory.mktemp("mla_drafter_parity") / "deepseek_target"
    model.save_pretrained(path)
    return path, model


@pytest.mark.parametrize("case_name", list(CASES))
@torch.no_grad()
def test_mla_drafter_parity(case_name, device, hf_target, tmp_path, record_error):
    case = CASES[case_name]
    tdev = torch.device(device)
    hf_dir, hf_model = hf_target
    errors: dict[str, float] = {}

    def check(what: str, jax_value, ref_value) -> None:
        errors[what] = record_error(what, rel_err(np32(jax_value), np32(ref_value)))

    target = eagle_jax.load_target(hf_dir, dtype="float32")
    cfg = case.config_json()
    ref_cfg = RefDrafterConfig.from_dict(cfg)
    assert ref_cfg.mla
    ref = RefDrafter(ref_cfg).random_init_(seed=sum(map(ord, case_name)))
    # The drafter's embedding is the target's (a checkpoint that carries it carries that copy).
    target_embed = hf_model.model.embed_tokens.weight.detach().to("cpu", torch.float32).clone()
    ref.embed_tokens.weight.copy_(target_embed)
    ckpt = tmp_path / "drafter"
    write_checkpoint(ref, case, cfg, ckpt)
    drafter = eagle_jax.load_drafter(ckpt, target)
    ref = ref.to(device=tdev).eval()

    # ---- what the loader read
    dc = drafter.config
    assert dc.mla is not None and type(drafter.self_attn).__name__ == "MLAttention"
    assert dc.architectures == tuple(cfg["architectures"])
    assert (
        dc.mla.q_lora_rank,
        dc.mla.kv_lora_rank,
        dc.mla.qk_nope_head_dim,
        dc.mla.qk_rope_head_dim,
        dc.mla.v_head_dim,
    ) == (
        ref_cfg.q_lora_rank,
        ref_cfg.kv_lora_rank,
        ref_cfg.qk_nope_head_dim,
        ref_cfg.qk_rope_head_dim,
        ref_cfg.v_head_dim,
    )
    assert (dc.fc_norm, dc.norm_output, dc.draft_vocab_size) == (
        ref_cfg.fc_norm,
        ref_cfg.norm_output,
        ref_cfg.draft_vocab_size,
    )
    assert dc.rope.theta == ref_cfg.rope_theta
    assert dc.rope.type == (ref_cfg.rope_scaling or {"type": "default"})["type"]
    assert dc.aux_layer_ids == TARGET_AUX
    np.testing.assert_array_equal(host(drafter.d2t[...]), ref.d2t.cpu().numpy())
    np.testing.assert_array_equal(host(drafter.t2d[...]), ref.t2d.cpu().numpy())
    np.testing.assert_array_equal(np32(drafter.embed_tokens[...]), np32(ref.embed_tokens.weight))

    # ---- inputs: the JAX target's aux states (checked against HF's hidden states)
    n = T + STEPS
    prompt = torch.randint(0, V, (B, n + 1), generator=torch.Generator().manual_seed(1))
    _, aux = target(dev(prompt[:, :n].numpy(), np.int32), dc.aux_layer_ids)
    aux32 = np32(aux)
    _, hs = hf_forward(hf_model, prompt[:, :n].numpy())
    assert rel_err(aux32, torch.cat([hs[i] for i in TARGET_AUX], dim=-1)) <= TOL
    aux_t = torch.from_numpy(aux32).to(tdev)
    ids_n = prompt[:, 1:].numpy().astype(np.int32)
    ids_t = prompt[:, 1:].to(tdev)

    # ---- full sequence (positions 0..T-1), fc path
    ref_logits, ref_next = ref(aux_t[:, :T], ids_t[:, :T])
    jax_logits, jax_next = drafter(dev(aux32[:, :T]), dev(ids_n[:, :T]))
    check("full_logits", jax_logits, ref_logits)
    check("full_next_feature", jax_next, ref_next)

    # ---- cached: prefill block (expanded), a block of STEPS pairs (absorbed), CHAIN own-feature steps
    slots = n + CHAIN
    pos = np.broadcast_to(np.arange(n), (B, n))
    pos_t = torch.from_numpy(pos.copy()).to(tdev)
    g_t, g_j = ref.fuse(aux_t), drafter.fuse(dev(aux32))
    check("fuse", g_j, g_t)
    g_n = host(g_j)
    cache = drafter.init_cache(B, slots)
    assert cache[0].shape == (B, 1, slots, dc.mla.kv_lora_rank) and cache[1].shape == (
        B,
        1,
        slots,
        dc.mla.qk_rope_head_dim,
    )
    r_pre, r_pre_n, kv = ref.step(g_t[:, :T], ids_t[:, :T], pos_t[:, :T])
    block_mask = dev(np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T)))  # the block over itself
    j_pre, j_pre_n, _, cache = drafter.step(
        dev(g_n[:, :T]), dev(ids_n[:, :T]), dev(pos[:, :T], np.int32), block_mask, cache, dev(np.zeros(B, np.int32))
    )
    r_blk, r_blk_n, kv = ref.step(g_t[:, T:n], ids_t[:, T:n], pos_t[:, T:n], past_kv=kv)
    j_blk, j_blk_n, _, cache = drafter.step(
        dev(g_n[:, T:n]),
        dev(ids_n[:, T:n]),
        dev(pos[:, T:n], np.int32),
        slot_mask(pos[:, T:n], slots),
        cache,
        dev(np.full(B, T, np.int32)),
    )
    check("cached_logits", np.concatenate([np32(j_pre), np32(j_blk)], 1), torch.cat([r_pre, r_blk], 1))
    check("cached_next_feature", np.concatenate([np32(j_pre_n), np32(j_blk_n)], 1), torch.cat([r_pre_n, r_blk_n], 1))
    latents, rot_keys = ref.mla_latents(g_t, ids_t[:, :n], pos_t)
    check("cache_latents", np32(cache[0])[:, 0, :n], latents)
    check("cache_rope_keys", np32(cache[1])[:, 0, :n], rot_keys)

    r_lg, r_feat, j_feat = r_blk[:, -1:], r_blk_n[:, -1:], j_blk_n[:, -1:]
    chain_r, chain_j = [], []
    for i in range(CHAIN):
        token = ref.draft_to_target(r_lg[:, -1].argmax(-1))[:, None]  # [B, 1] target ids
        p = n + i
        r_lg, r_feat, kv = ref.step(r_feat, token, torch.full((B, 1), p, device=tdev), past_kv=kv)
        j_lg, j_feat, _, cache = drafter.step(
            j_feat,
            dev(token.cpu().numpy(), np.int32),
            dev(np.full((B, 1), p, np.int32)),
            slot_mask(np.full((B, 1), p), slots),
            cache,
            dev(np.full(B, p, np.int32)),
        )
        chain_r += [r_lg, r_feat]
        chain_j += [j_lg, j_feat]
    check("chain_logits", np.concatenate([np32(x) for x in chain_j[0::2]], 1), torch.cat(chain_r[0::2], 1))
    check("chain_next_feature", np.concatenate([np32(x) for x in chain_j[1::2]], 1), torch.cat(chain_r[1::2], 1))

    # ---- round trip: save_drafter -> the reference reads config.json and the tensors strictly
    out = tmp_path / "saved"
    eagle_jax.save_drafter(drafter, out)
    saved_cfg = json.loads((out / "config.json").read_text())
    assert saved_cfg["architectures"] == cfg["architectures"] and saved_cfg["model_type"] == "deepseek_v3"
    cfg2 = RefDrafterConfig.from_dict(saved_cfg)
    assert dataclasses.asdict(cfg2) == dataclasses.asdict(ref_cfg), (
        "config.json written by save_drafter reads back differently"
    )
    sd2 = load_file(str(out / "model.safetensors"))
    assert not any(k.startswith(("layers.", "model.")) for k in sd2), "save_drafter writes the midlayer.* layout"
    assert "embed_tokens.weight" not in sd2 and sd2["d2t"].dtype == torch.int64 and sd2["t2d"].dtype == torch.bool
    ref_sd = ref.state_dict()
    for k, v in sd2.items():  # bit-exact: the reference's weights
        assert torch.equal(v.to(tdev), ref_sd[k]), f"saved tensor {k} differs from the reference's"
    ref2 = RefDrafter(cfg2)
    load_eagle_state_dict(ref2, sd2, target_embed)
    rt_logits, rt_next = ref2.to(tdev).eval()(aux_t[:, :T], ids_t[:, :T])
    check("roundtrip_logits", jax_logits, rt_logits)
    check("roundtrip_next_feature", jax_next, rt_next)
    again = eagle_jax.load_drafter(out, target)
    assert again.config == dc
    a_l, a_n = again(dev(aux32[:, :T]), dev(ids_n[:, :T]))
    np.testing.assert_array_equal(np32(a_l), np32(jax_logits))
    np.testing.assert_array_equal(np32(a_n), np32(jax_next))

    bad = {k: v for k, v in errors.items() if not v <= TOL}
    assert not bad, f"rel err above {TOL:g}: " + ", ".join(f"{k}={v:.2e}" for k, v in bad.items())
