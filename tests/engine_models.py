"""Tiny target/drafter pairs for the engine tests, some built by hand so that drafts are often accepted.

``markov_target`` / ``markov_drafter``: a target that is (almost) a bigram Markov model of the current token, and a
drafter that predicts that bigram from the current input token, so chain drafts are accepted for long runs and
rejected where the two successor maps differ on purpose (mixed accept/reject rounds).

Target: one-hot-like embeddings ``e_v = onehot(v) + onehot(H-1)`` (the last dimension is a constant
"bias unit"); every layer's o_proj / down_proj kernel is scaled by ``eps`` so the residual stream stays
close to ``e_v`` (small but nonzero context effects: the target cache still matters for the output);
the lm_head row of token v puts a margin on ``succ[v]``, a single cycle through the vocabulary (greedy
text does not fall into a short loop).

Drafter: the query and key read only the bias unit with a large constant, so with a short RoPE
wavelength (theta 10) attention is sharply peaked on the pair's own slot; the value reads the token
embedding (plus a little of the fused target feature, so the drafter's cache depends on the features),
o_proj is the identity, the MLP is off; h2 is then ~ the embedding of the pair's token x_{t+1}, and the
lm_head maps it to ``draft_succ[x_{t+1}]``, i.e. the token after next. For ranks below the first the
lm_head prefers the target's own successor, so tree siblings can rescue a wrong first choice.
``markov_mla_drafter`` is the same drafter with multi-head latent attention: the shared rope key and
the queries' rope part read the bias unit (the peak on the pair's own slot), the latent copies the
token embedding (plus a little of the feature) and kv_b_proj's value half decodes it back.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax import Drafter, DrafterConfig, RopeConfig, Target, TargetConfig
from eagle_jax.config import MLAConfig, MoEConfig, default_aux_layer_ids


def target_config(vocab: int, hidden: int = 64, layers: int = 3, **kw) -> TargetConfig:
    return TargetConfig(
        architecture="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=hidden // 4,
        rms_norm_eps=1e-6,
        max_position_embeddings=kw.pop("max_position_embeddings", 256),
        **kw,
    )


def deepseek_config(vocab: int, hidden: int = 64, layers: int = 3, **kw) -> TargetConfig:
    """A tiny DeepSeek-V3-style target: MLA (q LoRA, YaRN), one dense layer, then 8 experts (top-2 of
    the best of 2 groups) plus a shared expert."""
    return TargetConfig(
        architecture="deepseek_v3",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=4,
        head_dim=24,
        rms_norm_eps=1e-6,
        rope=RopeConfig(
            theta=10000.0, type="yarn", factor=4.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=0.8
        ),
        max_position_embeddings=kw.pop("max_position_embeddings", 256),
        mla=MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=32),
        moe=MoEConfig(
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.0,
            first_k_dense_replace=1,
        ),
        **kw,
    )


def drafter_config(tc: TargetConfig, draft_vocab: int | None = None, hidden: int | None = None, **kw) -> DrafterConfig:
    hidden = hidden or tc.hidden_size
    return DrafterConfig(
        hidden_size=hidden,
        num_heads=4,
        num_kv_heads=kw.pop("num_kv_heads", 2),
        head_dim=hidden // 4,
        intermediate_size=2 * hidden,
        vocab_size=tc.vocab_size,
        draft_vocab_size=draft_vocab or tc.vocab_size,
        target_hidden_size=tc.hidden_size,
        num_aux_hidden_states=len(default_aux_layer_ids(tc.num_layers)),
        max_position_embeddings=tc.max_position_embeddings,
        **kw,
    )


def random_pair(vocab: int = 32, hidden: int = 32, seed: int = 0, logit_scale: float = 1.0, layers: int = 3, **dkw):
    """Random-weight target and drafter (the drafter shares the target's embedding)."""
    tc = target_config(vocab, hidden, layers=layers)
    target = Target(tc, rngs=nnx.Rngs(seed))
    if logit_scale != 1.0:
        target.lm_head.kernel.set_value(target.lm_head.kernel[...] * logit_scale)
    drafter = Drafter(drafter_config(tc, **dkw), embed=target.embed_tokens[...], rngs=nnx.Rngs(seed + 1))
    return target, drafter


def _set(param, value) -> None:
    param.set_value(jnp.asarray(value, param[...].dtype))


def successor_maps(vocab: int, seed: int, disagree: float):
    """(succ, draft_succ): the target's bigram successor map and the drafter's, differing on ``disagree``."""
    rng = np.random.default_rng(seed)
    # One cycle through the whole vocabulary: greedy text does not fall into a short loop.
    order = rng.permutation(vocab)
    succ = np.empty(vocab, np.int64)
    succ[order] = np.roll(order, -1)
    draft_succ = succ.copy()
    wrong = rng.random(vocab) < disagree
    draft_succ[wrong] = (succ[wrong] + 1 + rng.integers(0, vocab - 1, size=int(wrong.sum()))) % vocab
    return succ, draft_succ


def markov_target(
    vocab: int = 32,
    hidden: int = 64,
    seed: int = 0,
    eps: float = 0.05,
    margin: float = 1.0,
    config: TargetConfig | None = None,
) -> tuple[Target, np.ndarray]:
    """The near-bigram target of the module docstring; returns (target, succ).

    ``eps`` scales the layers' o_proj / down_proj: 0 gives an exact bigram model, ~0.1 lets the context
    change some greedy choices (about one in eight here), larger values soon drown the bigram.
    ``config``: another architecture of that vocabulary and width (e.g. ``deepseek_config``); its
    routed and shared experts are damped alike and its routers get a random selection bias.
    """
    assert vocab < hidden
    succ, _ = successor_maps(vocab, seed, 0.0)
    tc = config or target_config(vocab, hidden)
    t = Target(tc, rngs=nnx.Rngs(seed))
    embed = np.zeros((vocab, hidden), np.float32)
    embed[np.arange(vocab), np.arange(vocab)] = 1.0
    embed[:, hidden - 1] = 1.0
    _set(t.embed_tokens, embed)
    rng = np.random.default_rng(seed + 50)
    for layer in t.layers:
        _set(layer.self_attn.o_proj.kernel, layer.self_attn.o_proj.kernel[...] * eps)
        mlp = layer.mlp
        downs = [mlp.experts.down_proj, mlp.shared_experts.down_proj] if hasattr(mlp, "experts") else [mlp.down_proj]
        for down in downs:
            _set(down.kernel, down.kernel[...] * eps)
        if hasattr(mlp, "gate"):
            bias = mlp.gate.e_score_correction_bias
            _set(bias, rng.normal(0, 0.5, bias[...].shape))
    rng = np.random.default_rng(seed + 100)
    head = rng.normal(0, 0.1, (hidden, vocab)).astype(np.float32)
    head[np.arange(vocab), succ] += margin
    head[hidden - 1] = 0.0
    _set(t.lm_head.kernel, head)
    return t, succ


def markov_pair(vocab: int = 32, hidden: int = 64, seed: int = 0):
    """(target, drafter): the near-bigram target and a drafter that disagrees with it a quarter of the time."""
    target, succ = markov_target(vocab=vocab, hidden=hidden, seed=seed, eps=0.1)
    drafter, _ = markov_drafter(target, succ, seed=seed, disagree=0.25)
    return target, drafter


def markov_drafter(
    target: Target,
    succ: np.ndarray,
    seed: int = 0,
    disagree: float = 0.25,
    draft_vocab: list[int] | None = None,
    feature_mix: float = 0.005,
) -> tuple[Drafter, np.ndarray]:
    """The hand-built drafter described in the module docstring; returns (drafter, draft_succ).

    ``draft_vocab``: a sorted subset of target ids (Vd < V, exercises d2t); tokens outside it are never drafted.
    """
    tc = target.config
    v, h = tc.vocab_size, tc.hidden_size
    _, draft_succ = successor_maps(v, seed, disagree)
    dvocab = np.arange(v) if draft_vocab is None else np.asarray(sorted(draft_vocab))
    dc = drafter_config(tc, draft_vocab=len(dvocab), num_kv_heads=4, rope=RopeConfig(theta=10.0))
    d = Drafter(dc, embed=target.embed_tokens[...], rngs=nnx.Rngs(seed + 7))
    if draft_vocab is not None:
        d.set_vocab_map(dvocab - np.arange(len(dvocab)))
    rng = np.random.default_rng(seed + 200)
    hd = dc.num_heads * dc.head_dim
    bias_u = h - 1  # the bias unit in the embedding half of u = [norm(e), norm(g)]
    scale = float(np.sqrt(h / 2))  # value of norm(e_v) on its two nonzero dimensions
    c = 10.0 / scale
    wq = np.zeros((2 * h, hd), np.float32)
    wq[bias_u, :] = c
    wk = np.zeros((2 * h, dc.num_kv_heads * dc.head_dim), np.float32)
    wk[bias_u, :] = c
    wv = np.zeros((2 * h, dc.num_kv_heads * dc.head_dim), np.float32)
    wv[np.arange(h), np.arange(h)] = 1.0 / scale
    wv[h:] = rng.normal(0, feature_mix, (h, wv.shape[1]))
    _set(d.self_attn.q_proj.kernel, wq)
    _set(d.self_attn.k_proj.kernel, wk)
    _set(d.self_attn.v_proj.kernel, wv)
    _set(d.self_attn.o_proj.kernel, np.eye(hd, h, dtype=np.float32))
    _markov_head(d, succ, draft_succ, dvocab, rng)
    return d, draft_succ


def markov_mla_drafter(
    target: Target, succ: np.ndarray, seed: int = 0, disagree: float = 0.25, feature_mix: float = 0.005
) -> tuple[Drafter, np.ndarray]:
    """``markov_drafter`` with MLA attention (direct q_proj, latent as wide as H, 4 heads of 16 value
    dims = H); returns (drafter, draft_succ)."""
    tc = target.config
    v, h = tc.vocab_size, tc.hidden_size
    _, draft_succ = successor_maps(v, seed, disagree)
    mla = MLAConfig(kv_lora_rank=h, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=h // 4, q_lora_rank=None)
    dc = drafter_config(tc, num_kv_heads=4, rope=RopeConfig(theta=10.0), mla=mla)  # head_dim H/4 = qk_head_dim
    d = Drafter(dc, embed=target.embed_tokens[...], rngs=nnx.Rngs(seed + 7))
    rng = np.random.default_rng(seed + 200)
    heads, nope, rope, dv = dc.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
    bias_u = h - 1
    scale = float(np.sqrt(h / 2))  # value of norm(e_v) on its two nonzero dimensions
    c = 10.0 / scale
    wq = np.zeros((2 * h, heads, nope + rope), np.float32)
    wq[bias_u, :, nope:] = c  # rope part only: the peak comes from the rotation
    wkv = np.zeros((2 * h, h + rope), np.float32)
    wkv[np.arange(h), np.arange(h)] = 1.0  # latent = norm(e) (+ a little feature); kv_a_layernorm keeps it
    wkv[h:, :h] = rng.normal(0, feature_mix, (h, h))
    wkv[bias_u, h:] = c  # the shared rope key
    wb = np.zeros((h, heads, nope + dv), np.float32)
    for i in range(heads):  # head i's value = latent dims [i*dv, (i+1)*dv) / scale
        wb[i * dv + np.arange(dv), i, nope + np.arange(dv)] = 1.0 / scale
    _set(d.self_attn.q_proj.kernel, wq.reshape(2 * h, -1))
    _set(d.self_attn.kv_a_proj_with_mqa.kernel, wkv)
    _set(d.self_attn.kv_b_proj.kernel, wb.reshape(h, -1))
    _set(d.self_attn.o_proj.kernel, np.eye(h, dtype=np.float32))
    _markov_head(d, succ, draft_succ, np.arange(v), rng)
    return d, draft_succ


def _markov_head(d: Drafter, succ: np.ndarray, draft_succ: np.ndarray, dvocab: np.ndarray, rng) -> None:
    """MLP off, a small random fc, and the lm_head reading h2 ~ onehot(x) + onehot(H-1) (+ small noise;
    normed h2 ~ scale * that) as ``draft_succ[x]``, then the target's successors."""
    h = d.config.hidden_size
    _set(d.mlp.down_proj.kernel, np.zeros_like(d.mlp.down_proj.kernel[...]))
    _set(d.fc.kernel, rng.normal(0, 0.3 / np.sqrt(d.config.fc_in_features), d.fc.kernel[...].shape))
    head = rng.normal(0, 0.05, (h, len(dvocab))).astype(np.float32)
    pos = {int(t): i for i, t in enumerate(dvocab)}
    for x in range(len(succ)):
        ranks = list(dict.fromkeys([int(draft_succ[x]), int(succ[x]), int(succ[succ[x]])]))
        bonus = 1.0
        for tok in ranks:
            if tok in pos:
                head[x, pos[tok]] += bonus
                bonus *= 0.5
    head[h - 1] = 0.0
    _set(d.lm_head.kernel, head)
