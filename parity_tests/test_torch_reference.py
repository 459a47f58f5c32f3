"""Self-consistency tests of the PyTorch reference (no JAX involved).

Tolerances: fp32 on CPU; the compared paths do the same math in a different grouping (cache vs
full sequence, concatenated vs masked softmax), so 1e-5 absolute on O(1) logits is ample while any
indexing/shift/mask error moves values by O(0.1).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from parity_tests.torch_reference import (
    RefDrafter,
    RefDrafterConfig,
    load_eagle_state_dict,
    rope_cos_sin,
    shift_left,
    ttt_loss,
    ttt_unroll,
)

ATOL = 1e-5


def cfg_dict(**kw) -> dict:
    d = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # != H/heads on purpose
        intermediate_size=48,
        rms_norm_eps=1e-5,
        vocab_size=96,
        draft_vocab_size=64,
        target_hidden_size=24,  # != H: fc input is 3*24
        num_hidden_layers=1,
    )
    d.update(kw)
    return d


def make(seed: int = 0, **kw) -> RefDrafter:
    return RefDrafter(RefDrafterConfig.from_dict(cfg_dict(**kw))).random_init_(seed).eval()


def inputs(m: RefDrafter, B: int = 2, T: int = 9, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    c = m.cfg
    aux = torch.randn(B, T, c.fc_in, generator=g)
    ids = torch.randint(0, c.vocab_size, (B, T), generator=g)
    return aux, ids


VARIANTS = [dict(), dict(fc_norm=True, norm_output=True), dict(norm_before_fc=True)]


@pytest.mark.parametrize("kw", VARIANTS)
@torch.no_grad()
def test_cached_decode_matches_full_forward(kw):
    m = make(**kw)
    aux, ids = inputs(m)
    B, T = ids.shape
    full_logits, full_next = m(aux, ids)
    g = m.fuse(aux)
    # Prefill 4 positions as a block, then one position at a time through the cache.
    P = 4
    pos = torch.arange(T)[None].expand(B, T)
    lg, nx, kv = m.step(g[:, :P], ids[:, :P], pos[:, :P])
    outs_l, outs_n = [lg], [nx]
    for t in range(P, T):
        lg, nx, kv = m.step(g[:, t : t + 1], ids[:, t : t + 1], pos[:, t : t + 1], past_kv=kv)
        outs_l.append(lg)
        outs_n.append(nx)
    assert kv[0].shape == (B, m.cfg.num_key_value_heads, T, m.cfg.head_dim)
    torch.testing.assert_close(torch.cat(outs_l, 1), full_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(outs_n, 1), full_next, atol=ATOL, rtol=0)


@torch.no_grad()
def test_norm_placement():
    """logits = lm_head(norm(h2)) for both variants; only the fed-forward feature differs."""
    a, b = make(), make(norm_output=True)
    aux, ids = inputs(a)
    la, na = a(aux, ids)
    lb, nb = b(aux, ids)
    torch.testing.assert_close(la, lb, atol=0, rtol=0)
    torch.testing.assert_close(nb, a.norm(na), atol=ATOL, rtol=0)
    torch.testing.assert_close(la, a.lm_head(a.norm(na)), atol=ATOL, rtol=0)


YARN = dict(
    type="yarn",
    factor=4.0,
    original_max_position_embeddings=6,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=0.8,
)
MLA = dict(kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(rope_scaling=dict(type="linear", factor=2.0)), dict(MLA), dict(MLA, rope_scaling=YARN)],
    ids=["default", "linear", "mla", "mla_yarn"],
)
@torch.no_grad()
def test_reference_runs_on_its_inputs_device(kw):
    """Every table the reference builds lands on its inputs' device: the parity tests' cuda cases move
    the model and inputs to the GPU (on the meta device here, which raises the same mismatch error)."""
    m = make(**kw).to("meta")
    logits, nxt = m(torch.zeros(2, 5, m.cfg.fc_in, device="meta"), torch.zeros(2, 5, dtype=torch.long, device="meta"))
    assert logits.device.type == nxt.device.type == "meta"


@torch.no_grad()
def test_fc_norm_is_applied():
    m = make(fc_norm=True)
    aux, ids = inputs(m)
    before = m.fuse(aux)
    m.fc_norm[1].weight.mul_(2.0)
    assert (m.fuse(aux) - before).abs().max() > 1e-2


@torch.no_grad()
def test_custom_mask_equals_truncated_context():
    """A mask hiding keys must equal not having them (mask plumbing of step())."""
    m = make()
    aux, ids = inputs(m, B=1, T=6)
    g = m.fuse(aux)
    pos = torch.arange(6)[None]
    # Query at index 5 sees only keys {0, 1, 5}.
    _, _, kv = m.step(g[:, :5], ids[:, :5], pos[:, :5])
    mask = torch.zeros(1, 1, 6, dtype=torch.bool)
    mask[..., [0, 1, 5]] = True
    l_mask, _, _ = m.step(g[:, 5:], ids[:, 5:], pos[:, 5:], past_kv=kv, attn_mask=mask)
    kv2 = (kv[0][:, :, :2], kv[1][:, :, :2])
    l_trunc, _, _ = m.step(g[:, 5:], ids[:, 5:], pos[:, 5:], past_kv=kv2)
    torch.testing.assert_close(l_mask, l_trunc, atol=ATOL, rtol=0)


def _direct_step0_loss(m, aux, ids, tl, lm, normalize):
    logits, _ = m(aux, shift_left(ids))
    t = shift_left(tl)
    mask = shift_left(lm.float()) * m.t2d[t.argmax(-1)].float()
    p = torch.softmax(t[..., m.t2d], -1)
    ce = -(p * torch.log_softmax(logits, -1)).sum(-1)
    den = ids.numel() if normalize == "all" else max(mask.sum().item(), 1.0)
    return (mask * ce).sum() / den


@pytest.mark.parametrize("normalize", ["all", "valid"])
@torch.no_grad()
def test_ttt_length1_equals_direct_loss(normalize):
    m = make()
    aux, ids = inputs(m)
    g = torch.Generator().manual_seed(5)
    tl = torch.randn(*ids.shape, m.cfg.vocab_size, generator=g) * 3
    lm = (torch.rand(ids.shape, generator=g) > 0.3).long()
    total, losses, accs = ttt_loss(m, aux, ids, tl, lm, ttt_length=1, normalize=normalize)
    want = _direct_step0_loss(m, aux, ids, tl, lm, normalize)
    torch.testing.assert_close(total, want, atol=ATOL, rtol=0)
    assert len(losses) == 1 and len(accs) == 1 and 0.0 <= accs[0].item() <= 1.0


@torch.no_grad()
def test_ttt_accuracy_and_decay():
    """Make the target agree with the drafter at step 0: accuracy 1 there; total = sum decay^i l_i."""
    m = make()
    aux, ids = inputs(m)
    B, T = ids.shape
    step_logits = ttt_unroll(m, aux, ids, ttt_length=3)
    # Target logits at t+1 peaked at the drafter's step-0 argmax (mapped to target ids).
    want_tgt = m.draft_to_target(step_logits[0].argmax(-1))  # [B, T], for target position t+1
    tl = torch.full((B, T, m.cfg.vocab_size), -5.0)
    tl[:, 1:].scatter_(-1, want_tgt[:, :-1, None], 5.0)
    lm = torch.ones(B, T, dtype=torch.long)
    total, losses, accs = ttt_loss(m, aux, ids, tl, lm, ttt_length=3, decay=0.5)
    assert accs[0].item() == 1.0
    torch.testing.assert_close(total, losses[0] + 0.5 * losses[1] + 0.25 * losses[2], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kw", [dict(), dict(norm_output=True, fc_norm=True)])
@torch.no_grad()
def test_ttt_unroll_matches_chain_decoding(kw):
    """Step i, index j of TTT == drafting i tokens after a prefix of target pairs 0..j.

    This pins the TTT attention pattern (causal step-0 keys + diagonal), the RoPE shift pos+i and
    the token/feature shifts to what inference does with the KV cache.
    """
    m = make(**kw)
    B, T, L = 2, 7, 4
    aux, ids = inputs(m, B=B, T=T)
    ttt = ttt_unroll(m, aux, ids, ttt_length=L)
    g = m.fuse(aux)
    tok = shift_left(ids)  # pairs (g_t, x_{t+1})
    for j in range(T):
        pos = torch.arange(j + 1)[None].expand(B, -1)
        lg, feat, kv = m.step(g[:, : j + 1], tok[:, : j + 1], pos)
        torch.testing.assert_close(lg[:, j], ttt[0][:, j], atol=ATOL, rtol=0)
        f = feat[:, j : j + 1]
        for i in range(1, L):
            t_idx = j + i
            x = tok[:, t_idx : t_idx + 1] if t_idx < T else torch.zeros(B, 1, dtype=ids.dtype)
            p = torch.full((B, 1), j + i)
            lg, feat, kv = m.step(f, x, p, past_kv=kv)
            torch.testing.assert_close(lg[:, 0], ttt[i][:, j], atol=ATOL, rtol=0)
            f = feat


# ---------------------------------------------------------------- loader


def _ckpt(m: RefDrafter) -> dict:
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    del sd["embed_tokens.weight"]
    return sd


@torch.no_grad()
def test_loader_round_trip_and_variants():
    src = make(seed=3, fc_norm=True)
    aux, ids = inputs(src)
    want, _ = src(aux, ids)
    embed = src.embed_tokens.weight.clone()

    dst = load_eagle_state_dict(make(seed=9, fc_norm=True), _ckpt(src), embed)
    torch.testing.assert_close(dst(aux, ids)[0], want, atol=0, rtol=0)

    # Variant layout: `model.` prefix (not on lm_head), layers.0.*, draft_id_to_target_id, no t2d.
    var = {}
    for k, v in _ckpt(src).items():
        if k == "t2d":
            continue
        if k == "d2t":
            k = "draft_id_to_target_id"
        k = k.replace("midlayer.", "layers.0.")
        var[k if k.startswith("lm_head") else "model." + k] = v
    dst2 = load_eagle_state_dict(make(seed=9, fc_norm=True), var, embed)
    torch.testing.assert_close(dst2(aux, ids)[0], want, atol=0, rtol=0)
    assert torch.equal(dst2.t2d, src.t2d) and torch.equal(dst2.d2t, src.d2t)


def test_loader_rejects():
    src = make()
    embed = src.embed_tokens.weight.detach().clone()
    bad = _ckpt(src)
    bad["midlayer.self_attn.q_proj.bias"] = torch.zeros(64)
    with pytest.raises(ValueError, match="unexpected"):
        load_eagle_state_dict(make(), bad, embed)
    bad = _ckpt(src)
    del bad["midlayer.hidden_norm.weight"]
    with pytest.raises(ValueError, match="missing"):
        load_eagle_state_dict(make(), bad, embed)
    bad = _ckpt(src)
    del bad["d2t"], bad["t2d"]
    with pytest.raises(ValueError, match="d2t"):  # Vd != V: never invent a map
        load_eagle_state_dict(make(), bad, embed)
    bad = _ckpt(src)
    bad["d2t"] = torch.zeros_like(bad["d2t"]) - 1
    with pytest.raises(ValueError, match="outside"):
        load_eagle_state_dict(make(), bad, embed)
    bad = _ckpt(src)
    bad["d2t"] = bad["d2t"].flip(0)
    with pytest.raises(ValueError):
        load_eagle_state_dict(make(), bad, embed)
    with pytest.raises(ValueError, match="embed"):
        load_eagle_state_dict(make(), _ckpt(src), None)
    bad = _ckpt(src)
    bad["fc.weight"] = bad["fc.weight"][:, :10]
    with pytest.raises(RuntimeError):  # shape mismatch from the strict torch load
        load_eagle_state_dict(make(), bad, embed)


def test_loader_identity_vocab_when_buffers_absent():
    src = make(draft_vocab_size=96)
    sd = _ckpt(src)
    del sd["d2t"], sd["t2d"]
    dst = load_eagle_state_dict(make(seed=4, draft_vocab_size=96), sd, src.embed_tokens.weight.detach())
    assert int(dst.d2t.abs().sum()) == 0 and bool(dst.t2d.all())


# ---------------------------------------------------------------- config


def test_fc_norm_and_norm_before_fc_rejected():
    with pytest.raises(ValueError, match="mutually exclusive"):
        RefDrafterConfig.from_dict(cfg_dict(fc_norm=True, norm_before_fc=True))


def test_config_dialects():
    c4 = RefDrafterConfig.from_dict(
        cfg_dict(
            rope_theta=500000.0,
            rope_scaling={"type": "linear", "factor": 2.0},
            eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4]},
        )
    )
    c5 = RefDrafterConfig.from_dict(
        cfg_dict(
            rope_parameters={"rope_type": "linear", "rope_theta": 500000.0, "factor": 2.0},
            eagle_aux_hidden_state_layer_ids=[1, 2, 3, 4],
        )
    )
    for c in (c4, c5):
        assert c.rope_theta == 500000.0 and c.rope_scaling == {"type": "linear", "factor": 2.0}
        assert c.num_aux_hidden_states == 4 and c.fc_in == 96
    c = RefDrafterConfig.from_dict(cfg_dict(head_dim=None, num_key_value_heads=None))
    assert (c.rope_theta, c.rope_scaling, c.head_dim, c.num_key_value_heads, c.num_aux_hidden_states) == (
        10000.0,
        None,
        8,
        4,
        3,
    )
    d = cfg_dict(
        draft_vocab_size=None, target_hidden_size=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
    )
    c = RefDrafterConfig.from_dict(d)
    assert (c.draft_vocab_size, c.target_hidden_size, c.rope_theta, c.rope_scaling) == (96, 32, 1e6, None)
    with pytest.raises(ValueError, match="yarn"):
        RefDrafterConfig.from_dict(cfg_dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_rope_linear_scaling_and_layout():
    base = RefDrafterConfig.from_dict(cfg_dict())
    lin = dataclasses.replace(base, rope_scaling={"type": "linear", "factor": 2.0})
    pos = torch.arange(0, 20, 2)[None]
    c1, s1 = rope_cos_sin(lin, pos, torch.float32)
    c2, s2 = rope_cos_sin(base, pos // 2, torch.float32)
    torch.testing.assert_close((c1, s1), (c2, s2), atol=0, rtol=0)
    # rotate-half layout: the two halves carry identical frequencies; position 0 is the identity.
    torch.testing.assert_close(c1[..., :8], c1[..., 8:], atol=0, rtol=0)
    assert torch.equal(c1[0, 0], torch.ones(16)) and torch.equal(s1[0, 0], torch.zeros(16))
    # dynamic: unchanged inside max_position_embeddings, changed beyond it.
    dyn = dataclasses.replace(base, rope_scaling={"type": "dynamic", "factor": 2.0}, max_position_embeddings=16)
    short = torch.arange(16)[None]
    torch.testing.assert_close(rope_cos_sin(dyn, short, torch.float32), rope_cos_sin(base, short, torch.float32))
    long = torch.arange(40)[None]
    assert (rope_cos_sin(dyn, long, torch.float32)[0] - rope_cos_sin(base, long, torch.float32)[0]).abs().max() > 1e-3


@torch.no_grad()
def test_half_precision_close_to_fp32():
    m = make()
    aux, ids = inputs(m)
    want, _ = m(aux, ids)
    mb = copy.deepcopy(m).to(torch.bfloat16)
    assert mb.d2t.dtype == torch.int64 and mb.t2d.dtype == torch.bool
    got, nxt = mb(aux.to(torch.bfloat16), ids)
    assert got.dtype == torch.bfloat16 and nxt.dtype == torch.bfloat16
    # bf16 has ~3 significant digits; a structural bug would be far larger.
    assert (got.float() - want).abs().max() < 0.15 * want.abs().max()


# ---------------------------------------------------------------- independent oracle: HF Llama pieces


def test_rmsnorm_and_rope_match_transformers_llama():
    """Pin the half-precision numerics (norm cast-then-weight order, fp32 cos/sin) to HF Llama."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    from parity_tests.torch_reference import RMSNorm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 64, generator=g) * 4).to(torch.bfloat16)
    w = (1 + 0.3 * torch.randn(64, generator=g)).to(torch.bfloat16)
    ours, hf = RMSNorm(64, 1e-5).to(torch.bfloat16), llama.LlamaRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.copy_(w)
        hf.weight.copy_(w)
        assert torch.equal(ours(x), hf(x))

    cfg = RefDrafterConfig.from_dict(cfg_dict(rope_theta=500000.0))
    hf_rope = llama.LlamaRotaryEmbedding(
        LlamaConfig(hidden_size=32, num_attention_heads=4, head_dim=16, rope_theta=500000.0)
    )
    pos = torch.tensor([[0, 1, 7, 300, 4095]])
    for dt in (torch.float32, torch.bfloat16):
        want = hf_rope(torch.zeros(1, 5, 16, dtype=dt), pos)
        got = rope_cos_sin(cfg, pos, dt)
        torch.testing.assert_close(got, want, atol=1e-6 if dt == torch.float32 else 0, rtol=0)
