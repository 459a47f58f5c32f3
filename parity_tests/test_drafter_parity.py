"""The JAX drafter against the independent PyTorch reference (parity_tests/torch_reference.py).

Each case builds a reference drafter with random weights (norm weights included), writes it as an
EAGLE checkpoint (config.json + model.safetensors, one case pytorch_model.bin), loads it through the
real import path (``eagle_jax.load_drafter`` against a tiny HF Llama target loaded with
``eagle_jax.load_target``) and compares, on identical inputs, draft logits and next features of:

- the full-sequence call ``drafter(aux, ids)`` vs ``ref.forward`` (and ``fuse`` alone);
- the fused-feature path (width-H features, no fc) vs ``ref.forward(..., fused=True)``;
- cached decoding: a prefill block then single steps through ``drafter.init_cache`` / ``step`` with
  masks over cache slots vs the reference's growing past_kv;
- the chain pattern: 3 more steps feeding each model its OWN next feature (width H) back, with the
  same tokens on both sides;
- round trip: ``save_drafter`` -> safetensors.torch.load_file -> strict ``load_eagle_state_dict`` into
  a fresh reference built from the written config.json -> same outputs as the JAX drafter.

Error measure: conftest.rel_err = max|jax - ref| / max|ref|; fp32 <= 1e-5, bf16 (reference cast to bf16,
JAX loaded with dtype="bfloat16") <= 2e-2. Every measured error goes to conftest's ``record_error``
(parity_tests/.last_parity_errors.json). Devices: conftest's ``device`` fixture (cpu; cuda when both
torch and JAX see a GPU).

Runtime: eager JAX compiles each op once per shape, so the cases share shapes where they can (the
cached prefill block has the full call's length T; single steps and chained steps are all length 1).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import eagle_jax
from parity_tests.conftest import hf_forward, rel_err, save_hf_model
from parity_tests.torch_reference import RefDrafter, RefDrafterConfig, load_eagle_state_dict

V = 128  # vocabulary of target and drafter
HT = 64  # target hidden size
# batch; full-sequence length = prefill block of the cached run; single cached steps on target
# features after it; chained steps on the drafter's own features after those
B, T, STEPS, CHAIN = 2, 8, 3, 3
DEFAULT_TARGET_AUX = (1, 2, 3)  # eagle_jax default for a 4-layer target ((2, L//2, L-3) collides)

TOL = {"float32": 1e-5, "bfloat16": 2e-2}
TORCH_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16}
JAX_DTYPE = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
NP_DTYPE = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}

BASE_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "hidden_size": HT,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "num_hidden_layers": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "vocab_size": V,
    "draft_vocab_size": V,
    "target_hidden_size": HT,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


@dataclass(frozen=True)
class Case:
    config: dict = field(default_factory=dict)  # overrides of BASE_CONFIG
    drop: tuple[str, ...] = ()  # BASE_CONFIG fields left out of config.json
    own_embed: bool = False  # the checkpoint carries embed_tokens.weight (drafter H != target H)
    file: str = "model.safetensors"  # or "pytorch_model.bin"
    alt_keys: bool = False  # `model.` prefix, `layers.0.*`, `draft_id_to_target_id`, no t2d
    keep_identity_map: bool = False  # write d2t/t2d even when Vd == V
    aux_convention: str = "input"
    expect_aux: tuple[int, ...] = DEFAULT_TARGET_AUX  # target layers the loaded drafter reads
    expect_theta: float = 10000.0

    def config_json(self) -> dict:
        d = {k: v for k, v in BASE_CONFIG.items() if k not in self.drop}
        d.update(self.config)
        return d


CASES = {
    "eagle3": Case(keep_identity_map=True),
    "fc_norm": Case(config={"fc_norm": True}),
    "norm_output": Case(config={"norm_output": True}),
    "eagle31": Case(config={"fc_norm": True, "norm_output": True}),
    "norm_before_fc": Case(config={"norm_before_fc": True}),
    # Drafter H=48 (head_dim 16: 4*16 != 48) reading a target with H=64: own embedding [V, 48].
    "hidden48": Case(config={"hidden_size": 48, "intermediate_size": 80}, own_embed=True),
    # 4 aux states named inside eagle_config (num_aux_hidden_states derived from the list).
    "aux4": Case(config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 0, 1, 2]}}, expect_aux=(0, 1, 2, 3)),
    # Vd < V with d2t/t2d, stored as a pickle-free pytorch_model.bin.
    "vocab_map_bin": Case(config={"draft_vocab_size": 80}, file="pytorch_model.bin"),
    "alt_keys": Case(config={"draft_vocab_size": 80}, alt_keys=True),
    # SGLang/SpecForge "output of layer j" ids: [0, 1, 2] means entering layers 1, 2, 3.
    "aux_output_convention": Case(
        config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
        aux_convention="output",
        expect_aux=(1, 2, 3),
    ),
    "rope_theta_absent": Case(drop=("rope_theta",), expect_theta=10000.0),
    "rope_theta_5e5": Case(config={"rope_theta": 500000.0}, expect_theta=500000.0),
    "rope_linear": Case(config={"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
}


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def hf_target(tmp_path_factory):
    """A tiny random HF Llama target (conftest.TINY: H=64, 4 layers, 4 heads, 2 kv heads, V=128) on disk:
    (directory, the torch model as transformers loads it back)."""
    return save_hf_model(tmp_path_factory.mktemp("drafter_parity"), "llama", seed=0, name="llama_target")


# -------------------------------------------------------------------------------------------- helpers


def write_checkpoint(ref: RefDrafter, case: Case, cfg: dict, path: Path) -> None:
    """The reference's weights as an EAGLE checkpoint directory (fp32 tensors)."""
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().clone().contiguous() for k, v in ref.state_dict().items()}
    if not case.own_embed:
        del sd["embed_tokens.weight"]  # engines take the target's
    if cfg["draft_vocab_size"] == cfg["vocab_size"] and not case.keep_identity_map:
        del sd["d2t"], sd["t2d"]  # both absent = identity
    if case.alt_keys:
        out = {}
        for k, v in sd.items():
            if k == "t2d":
                continue  # derived from d2t
            if k == "d2t":
                k = "draft_id_to_target_id"
            k = k.replace("midlayer.", "layers.0.", 1)
            out[k if k.startswith("lm_head") else "model." + k] = v
        sd = out
    if case.file == "model.safetensors":
        save_file(sd, str(path / case.file))
    else:
        torch.save(sd, path / case.file)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def np32(x) -> np.ndarray:
    """float32 numpy copy of a torch tensor or JAX array (converted in numpy: no JAX op to compile)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float32).numpy()
    return np.asarray(jax.device_get(x)).astype(np.float32)


def host(x) -> np.ndarray:
    """A JAX array as numpy in its own dtype (bf16 stays ml_dtypes.bfloat16)."""
    return np.asarray(jax.device_get(x))


def dev(x: np.ndarray, dtype=None) -> jax.Array:
    """numpy -> JAX on the default device. Casting and slicing happen in numpy and the transfer is a
    device_put: eager JAX compiles one executable per distinct slice / cast / ``jnp.asarray`` shape, and
    those compiles dominate the runtime of these tiny models."""
    x = np.asarray(x)
    return jax.device_put(x if dtype is None else x.astype(dtype))


def slot_mask(q_pos: np.ndarray, slots: int) -> jax.Array:
    """[B, Tq, S] boolean mask over cache slots: slot s holds position s; causal."""
    return dev(np.arange(slots)[None, None, :] <= q_pos[:, :, None])


# ---------------------------------------------------------------------------------------------- test


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case_name", list(CASES))
@torch.no_grad()
def test_drafter_parity(case_name, dtype, device, hf_target, tmp_path, record_error):
    """``device`` (conftest) has set JAX's default device and full-precision fp32 matmuls (no TF32)."""
    case = CASES[case_name]
    tol, tdt, jdt, ndt = TOL[dtype], TORCH_DTYPE[dtype], JAX_DTYPE[dtype], NP_DTYPE[dtype]
    tdev = torch.device(device)
    hf_dir, hf_model = hf_target
    errors: dict[str, float] = {}

    def check(what: str, jax_value, ref_value) -> None:
        errors[what] = record_error(what, rel_err(np32(jax_value), np32(ref_value)))

    # ---- target + checkpoint through the real import path
    target = eagle_jax.load_target(hf_dir, dtype="float32")
    cfg = case.config_json()
    ref_cfg = RefDrafterConfig.from_dict(cfg)
    ref = RefDrafter(ref_cfg).random_init_(seed=sum(map(ord, case_name)))
    target_embed = hf_model.model.embed_tokens.weight.detach().to("cpu", torch.float32).clone()
    if not case.own_embed:
        ref.embed_tokens.weight.copy_(target_embed)
    ckpt = tmp_path / "drafter"
    write_checkpoint(ref, case, cfg, ckpt)
    drafter = eagle_jax.load_drafter(ckpt, target, dtype=dtype, aux_convention=case.aux_convention)
    ref = ref.to(device=tdev, dtype=tdt).eval()

    # ---- what the loader read
    dc = drafter.config
    assert drafter.dtype == jdt
    assert (dc.fc_norm, dc.norm_output, dc.norm_before_fc) == (
        ref_cfg.fc_norm,
        ref_cfg.norm_output,
        ref_cfg.norm_before_fc,
    )
    assert (dc.hidden_size, dc.target_hidden_size, dc.num_aux_hidden_states, dc.draft_vocab_size) == (
        ref_cfg.hidden_size,
        ref_cfg.target_hidden_size,
        ref_cfg.num_aux_hidden_states,
        ref_cfg.draft_vocab_size,
    )
    assert dc.rope.theta == ref_cfg.rope_theta == case.expect_theta
    if ref_cfg.rope_scaling is not None:
        assert (dc.rope.type, dc.rope.factor) == (ref_cfg.rope_scaling["type"], ref_cfg.rope_scaling["factor"])
    else:
        assert dc.rope.type == "default"
    assert dc.aux_layer_ids == case.expect_aux, "the drafter does not read the layers its checkpoint names"
    np.testing.assert_array_equal(host(drafter.d2t[...]), ref.d2t.cpu().numpy())
    np.testing.assert_array_equal(host(drafter.t2d[...]), ref.t2d.cpu().numpy())
    assert int(host(drafter.t2d[...]).sum()) == dc.draft_vocab_size
    draft_ids = np.arange(dc.draft_vocab_size)
    np.testing.assert_array_equal(
        host(drafter.draft_to_target(dev(draft_ids))),
        ref.draft_to_target(torch.as_tensor(draft_ids, device=tdev)).cpu().numpy(),
    )
    np.testing.assert_array_equal(np32(drafter.embed_tokens[...]), np32(ref.embed_tokens.weight))

    # ---- inputs: aux states of the JAX target (now capturing the drafter's layers); the token paired
    # with feature t is x_{t+1}
    n = T + STEPS
    prompt = torch.randint(0, V, (B, n + 1), generator=torch.Generator().manual_seed(1))
    _, aux = target(dev(prompt[:, :n].numpy(), np.int32), dc.aux_layer_ids)
    aux32 = np32(aux)
    _, hs = hf_forward(hf_model, prompt[:, :n].numpy())
    check("target_aux_vs_hf_hidden_states", aux32, torch.cat([hs[i] for i in case.expect_aux], dim=-1))
    assert errors.pop("target_aux_vs_hf_hidden_states") <= 1e-5, f"aux != HF hidden_states{list(case.expect_aux)}"

    aux_t = torch.from_numpy(aux32).to(tdev, tdt)
    aux_n = aux32.astype(ndt)
    ids_n = prompt[:, 1:].numpy().astype(np.int32)
    ids_t = prompt[:, 1:].to(tdev)

    # ---- full sequence (positions 0..T-1), fc path
    ref_logits, ref_next = ref(aux_t[:, :T], ids_t[:, :T])
    jax_logits, jax_next = drafter(dev(aux_n[:, :T]), dev(ids_n[:, :T]))
    check("full_logits", jax_logits, ref_logits)
    check("full_next_feature", jax_next, ref_next)
    g_t, g_j = ref.fuse(aux_t), drafter.fuse(dev(aux_n))
    check("fuse", g_j, g_t)

    # ---- fused-feature path: width-H features (the reference's own next features) skip fc
    feats32 = np32(ref_next)
    r_l, r_n = ref(torch.from_numpy(feats32).to(tdev, tdt), ids_t[:, :T], fused=True)
    j_l, j_n = drafter(dev(feats32, ndt), dev(ids_n[:, :T]))
    check("fused_path_logits", j_l, r_l)
    check("fused_path_next_feature", j_n, r_n)

    # ---- cached decoding: the first T pairs as one block, then STEPS single pairs of target features
    slots = n + CHAIN
    pos = np.broadcast_to(np.arange(n), (B, n))
    pos_t = torch.from_numpy(pos.copy()).to(tdev)
    cache = drafter.init_cache(B, slots)
    assert cache[0].shape == (B, dc.num_kv_heads, slots, dc.head_dim) and cache[0].dtype == jdt
    r_lg, r_nx, kv = ref.step(g_t[:, :T], ids_t[:, :T], pos_t[:, :T])
    g_n = host(g_j)
    j_lg, j_nx, _, cache = drafter.step(
        dev(g_n[:, :T]),
        dev(ids_n[:, :T]),
        dev(pos[:, :T], np.int32),
        slot_mask(pos[:, :T], slots),
        cache,
        dev(np.zeros(B, np.int32)),
    )
    ref_l, ref_n, jx_l, jx_n = [r_lg], [r_nx], [j_lg], [j_nx]
    for t in range(T, n):
        r_lg, r_nx, kv = ref.step(g_t[:, t : t + 1], ids_t[:, t : t + 1], pos_t[:, t : t + 1], past_kv=kv)
        j_lg, j_nx, _, cache = drafter.step(
            dev(g_n[:, t : t + 1]),
            dev(ids_n[:, t : t + 1]),
            dev(pos[:, t : t + 1], np.int32),
            slot_mask(pos[:, t : t + 1], slots),
            cache,
            dev(np.full(B, t, np.int32)),
        )
        ref_l.append(r_lg), ref_n.append(r_nx), jx_l.append(j_lg), jx_n.append(j_nx)
    check("cached_logits", np.concatenate([np32(x) for x in jx_l], 1), torch.cat(ref_l, 1))
    check("cached_next_feature", np.concatenate([np32(x) for x in jx_n], 1), torch.cat(ref_n, 1))
    # the cache holds the reference's rotated keys and its values at slots 0..n-1
    check("cache_k", np32(cache[0])[:, :, :n], kv[0])
    check("cache_v", np32(cache[1])[:, :, :n], kv[1])

    # ---- chain: each model feeds its OWN width-H next feature back; the same tokens on both sides
    r_feat, j_feat = ref_n[-1], jx_n[-1]
    chain_rl, chain_rn, chain_jl, chain_jn = [], [], [], []
    for i in range(CHAIN):
        token = ref.draft_to_target(r_lg[:, -1].float().argmax(-1))[:, None]  # [B, 1] target ids
        p = n + i  # drafted step i of the round sits at position prefix_len + i
        r_lg, r_feat, kv = ref.step(r_feat, token, torch.full((B, 1), p, device=tdev), past_kv=kv)
        j_lg, j_feat, _, cache = drafter.step(
            j_feat,
            dev(token.cpu().numpy(), np.int32),
            dev(np.full((B, 1), p, np.int32)),
            slot_mask(np.full((B, 1), p), slots),
            cache,
            dev(np.full(B, p, np.int32)),
        )
        chain_rl.append(r_lg), chain_rn.append(r_feat), chain_jl.append(j_lg), chain_jn.append(j_feat)
    check("chain_logits", np.concatenate([np32(x) for x in chain_jl], 1), torch.cat(chain_rl, 1))
    check("chain_next_feature", np.concatenate([np32(x) for x in chain_jn], 1), torch.cat(chain_rn, 1))

    # ---- round trip: save_drafter -> torch strict load -> same outputs as the JAX drafter
    out = tmp_path / "saved"
    eagle_jax.save_drafter(drafter, out)
    cfg2 = RefDrafterConfig.from_dict(json.loads((out / "config.json").read_text()))
    assert dataclasses.asdict(cfg2) == dataclasses.asdict(ref_cfg), (
        "config.json written by save_drafter reads back differently"
    )
    sd2 = load_file(str(out / "model.safetensors"))
    assert all(v.dtype == tdt for k, v in sd2.items() if k not in ("d2t", "t2d")), {k: v.dtype for k, v in sd2.items()}
    assert sd2["d2t"].dtype == torch.int64 and sd2["t2d"].dtype == torch.bool
    assert ("embed_tokens.weight" in sd2) == case.own_embed
    ref_sd = ref.state_dict()
    for k, v in sd2.items():  # the weights come back bit-exact (they are the reference's, in dtype)
        assert torch.equal(v.to(tdev), ref_sd[k]), f"saved tensor {k} differs from the reference's"
    ref2 = RefDrafter(cfg2)
    load_eagle_state_dict(ref2, sd2, None if case.own_embed else target_embed)
    ref2 = ref2.to(device=tdev, dtype=tdt).eval()
    rt_logits, rt_next = ref2(aux_t[:, :T], ids_t[:, :T])
    check("roundtrip_logits", jax_logits, rt_logits)
    check("roundtrip_next_feature", jax_next, rt_next)
    # ... and the JAX loader reads its own output back identically (aux ids now in the 'input' convention)
    again = eagle_jax.load_drafter(out, target, dtype=dtype)
    assert again.config.aux_layer_ids == case.expect_aux
    a_l, a_n = again(dev(aux_n[:, :T]), dev(ids_n[:, :T]))
    np.testing.assert_array_equal(np32(a_l), np32(jax_logits))
    np.testing.assert_array_equal(np32(a_n), np32(jax_next))

    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"rel err above {tol:g} ({dtype}): " + ", ".join(f"{k}={v:.2e}" for k, v in bad.items())
