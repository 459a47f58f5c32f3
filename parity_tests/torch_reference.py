"""Independent plain-PyTorch reference of the EAGLE-3 / EAGLE-3.1 drafter and its TTT loss.

This module deliberately imports nothing from ``eagle_jax``: it is the yardstick the JAX code is
measured against, written from the EAGLE papers and the authors' code. It follows the numerics of the EAGLE authors'
reference code where they matter for half-precision parity:

- RMSNorm: compute in fp32, cast back to the input dtype, THEN multiply by the weight.
- Attention: scores in the model dtype, softmax in fp32, cast back to the model dtype.
- RoPE: ``inv_freq = 1/theta^(2i/d)`` and cos/sin in fp32, rotate-half (NeoX) layout, cast to the
  activation dtype before being applied.
- Residual adds in the model dtype. No bias anywhere. MLP = down(silu(gate(x)) * up(x)).

MLA drafters (DeepSeek-V3 / Kimi-K2 EAGLE-3, a config with ``kv_lora_rank``) replace the GQA attention
by multi-head latent attention over the same 2H input, computed as HF transformers' DeepseekV3Attention
does (per-head keys and values expanded from the latents, never the absorbed form): q from ``q_a_proj ->
q_a_layernorm -> q_b_proj`` (or ``q_proj``), ``kv_a_proj_with_mqa`` -> (latent, one shared rope key),
latent -> ``kv_a_layernorm`` -> ``kv_b_proj`` -> per-head (k_nope, v); RoPE only on the last
``qk_rope_head_dim`` numbers of q and k, in DeepSeek's interleaved-pair layout rotated as HF's
``apply_rotary_pos_emb_interleave``; scores times ``qk_head_dim**-0.5``, times
``yarn_get_mscale(factor, mscale_all_dim)**2`` under YaRN (HF's ``yarn_apply_mscale``); DeepSeek YaRN
frequencies and cos/sin scale as HF's ``_compute_yarn_parameters``. The latent norms use the drafter's
``rms_norm_eps`` (vLLM / SGLang / TorchSpec build them so; HF's target uses its default 1e-6).

Public API (see the docstrings): ``RefDrafterConfig``, ``RefDrafter``, ``load_eagle_state_dict``,
``make_vocab_map``, ``ttt_unroll``, ``ttt_loss``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

KV = tuple[torch.Tensor, torch.Tensor]  # (k, v), each [B, kv_heads, S, head_dim], k already rotated


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


_YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "original_max_position_embeddings")


def _parse_rope(d: Mapping[str, Any], allow_yarn: bool = False) -> tuple[float, dict[str, Any] | None]:
    """Read theta and scaling from either config dialect.

    transformers 4 / most checkpoints: top-level ``rope_theta`` + ``rope_scaling``.
    transformers >= 5: ``rope_parameters`` = {rope_type, rope_theta, factor, ...}.
    Returns (theta, scaling) with scaling None or {"type": "linear"|"dynamic", "factor": f, ...}, or
    for MLA drafters (``allow_yarn``) {"type": "yarn", "factor", "beta_fast", "beta_slow", "mscale",
    "mscale_all_dim", "original_max_position_embeddings"}.
    """
    params = d.get("rope_parameters") or {}
    theta = d.get("rope_theta")
    if theta is None:
        theta = params.get("rope_theta", 10000.0)  # the Llama-3.1-8B reference drafter has none
    scaling_src = d.get("rope_scaling")
    if scaling_src is None and params:
        scaling_src = params
    scaling: dict[str, Any] | None = None
    if scaling_src:
        kind = scaling_src.get("rope_type", scaling_src.get("type"))
        if kind in (None, "default"):
            scaling = None
        elif kind in ("linear", "dynamic"):
            if "factor" not in scaling_src:
                raise ValueError(f"rope scaling {kind!r} has no 'factor': {dict(scaling_src)}")
            scaling = {"type": kind, "factor": float(scaling_src["factor"])}
            if "original_max_position_embeddings" in scaling_src:
                scaling["original_max_position_embeddings"] = int(scaling_src["original_max_position_embeddings"])
        elif kind == "yarn" and allow_yarn:
            scaling = {"type": "yarn", "factor": float(scaling_src["factor"])}
            scaling.update({k: scaling_src.get(k) for k in _YARN_KEYS})
            if scaling["original_max_position_embeddings"] is None:
                scaling["original_max_position_embeddings"] = int(d.get("max_position_embeddings") or 2048)
        else:
            # Only linear and dynamic appear in GQA drafter code; never substitute another.
            raise ValueError(f"rope scaling type {kind!r} is not supported by the drafter reference")
    return float(theta), scaling


@dataclass
class RefDrafterConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    num_aux_hidden_states: int = 3
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_fc: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048  # only used by dynamic NTK scaling
    # MLA (set kv_lora_rank): heads = num_attention_heads, all of them reading one latent per token
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None  # None: a direct q_proj
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.fc_norm and self.norm_before_fc:
            raise ValueError("config: 'fc_norm' and 'norm_before_fc' are mutually exclusive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"config: draft_vocab_size={self.draft_vocab_size} > vocab_size={self.vocab_size}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RefDrafterConfig":
        """Build from a drafter HF config.json dict (either transformers dialect)."""
        H = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or H // heads)
        V = int(d["vocab_size"])
        Vd = int(d.get("draft_vocab_size") or V)
        if d.get("num_aux_hidden_states") is not None:
            n_aux = int(d["num_aux_hidden_states"])
        else:
            ids = d.get("eagle_aux_hidden_state_layer_ids")
            if ids is None:
                ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            n_aux = len(ids) if ids is not None else 3
        mla = d.get("kv_lora_rank") is not None
        theta, scaling = _parse_rope(d, allow_yarn=mla)
        max_pos = int(d.get("max_position_embeddings") or 2048)
        if scaling is not None and "original_max_position_embeddings" in scaling:
            max_pos = scaling["original_max_position_embeddings"]
        if mla:
            kv_heads, head_dim = heads, int(d["qk_nope_head_dim"]) + int(d["qk_rope_head_dim"])
            mla_fields = {
                k: d[k] for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
            }
        else:
            mla_fields = {}
        return cls(
            hidden_size=H,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(d["intermediate_size"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            vocab_size=V,
            draft_vocab_size=Vd,
            target_hidden_size=int(d.get("target_hidden_size") or H),
            num_aux_hidden_states=n_aux,
            fc_norm=bool(d.get("fc_norm", False)),
            norm_output=bool(d.get("norm_output", False)),
            norm_before_fc=bool(d.get("norm_before_fc", False)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            **mla_fields,
        )

    @property
    def fc_in(self) -> int:
        return self.num_aux_hidden_states * self.target_hidden_size

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.mla else self.head_dim


# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back BEFORE the weight multiply (reference order; matters in fp16/bf16).
        return self.weight * x32.to(dtype)


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class RefAttention(nn.Module):
    def __init__(self, cfg: RefDrafterConfig) -> None:
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = _linear(2 * H, cfg.num_attention_heads * hd)  # input = cat(embed, feature)
        self.k_proj = _linear(2 * H, cfg.num_key_value_heads * hd)
        self.v_proj = _linear(2 * H, cfg.num_key_value_heads * hd)
        self.o_proj = _linear(cfg.num_attention_heads * hd, H)


class RefMLAttention(nn.Module):
    """HF DeepseekV3Attention's weights, the two down-projections reading the 2H drafter input."""

    def __init__(self, cfg: RefDrafterConfig) -> None:
        super().__init__()
        H, heads = cfg.hidden_size, cfg.num_attention_heads
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = _linear(2 * H, heads * qk)
        else:
            self.q_a_proj = _linear(2 * H, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = _linear(cfg.q_lora_rank, heads * qk)
        self.kv_a_proj_with_mqa = _linear(2 * H, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = _linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = _linear(heads * cfg.v_head_dim, H)


class RefMLP(nn.Module):
    def __init__(self, cfg: RefDrafterConfig) -> None:
        super().__init__()
        self.gate_proj = _linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = _linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RefMidLayer(nn.Module):
    """Holds the decoder-layer weights under the authors' names (``midlayer.*``)."""

    def __init__(self, cfg: RefDrafterConfig) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = RefMLAttention(cfg) if cfg.mla else RefAttention(cfg)
        self.mlp = RefMLP(cfg)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(cfg: RefDrafterConfig, d: int) -> tuple[torch.Tensor, float]:
    """DeepSeek YaRN (HF ``_compute_yarn_parameters``): blended inverse frequencies and the cos/sin scale."""
    sc, base = cfg.rope_scaling, cfg.rope_theta
    factor = sc["factor"]
    ms, ms_all = sc.get("mscale"), sc.get("mscale_all_dim")
    attn = yarn_get_mscale(factor, ms) / yarn_get_mscale(factor, ms_all) if ms and ms_all else yarn_get_mscale(factor)
    orig = sc["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (d * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(sc.get("beta_fast") or 32)), 0)
    high = min(math.ceil(correction_dim(sc.get("beta_slow") or 1)), d - 1)
    if low == high:
        high += 0.001
    extrapolate = 1 - torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2).to(torch.float32) / d)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, attn


def rope_cos_sin(
    cfg: RefDrafterConfig, position_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [B, T, rope_dim], built in fp32 and cast to ``dtype``.

    linear scaling: positions / factor (as the EAGLE reference code does it).
    dynamic NTK: stateless; seq_len = max(position_ids) + 1, and theta is enlarged only when
    seq_len > max_position_embeddings (HF formula). Note this makes dynamic scaling depend on the
    positions present in the call.
    yarn (MLA drafters): DeepSeek YaRN, cos/sin times the attention factor.
    """
    d = cfg.rope_dim
    base = cfg.rope_theta
    pos = position_ids.to(torch.float32)
    sc = cfg.rope_scaling
    if sc is not None and sc["type"] == "yarn":
        inv_freq, attn = _yarn_inv_freq(cfg, d)
        freqs = pos[..., None] * inv_freq.to(pos.device)  # built on the host: the positions may be on a GPU
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * attn).to(dtype), (emb.sin() * attn).to(dtype)
    if sc is not None and sc["type"] == "dynamic":
        seq_len = int(position_ids.max().item()) + 1
        if seq_len > cfg.max_position_embeddings:
            f = sc["factor"]
            base = base * ((f * seq_len / cfg.max_position_embeddings) - (f - 1)) ** (d / (d - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64, device=pos.device).to(torch.float32) / d))
    if sc is not None and sc["type"] == "linear":
        pos = pos / sc["factor"]
    freqs = pos[..., None] * inv_freq  # [B, T, d/2], fp32
    emb = torch.cat((freqs, freqs), dim=-1)  # rotate-half layout: both halves share frequencies
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, hd]; cos/sin: [B, T, hd]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved pairs (x0, x1), (x2, x3), ... each rotated by one frequency, written as HF's
    ``apply_rotary_pos_emb_interleave``: the rotated evens then the rotated odds (the same permutation
    for queries and keys, so q.k is the in-place rotation's). x: [B, heads, T, d]; cos/sin: [B, T, d]."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :, :half], sin[:, None, :, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def mla_softmax_scale(cfg: RefDrafterConfig) -> float:
    """HF DeepseekV3Attention.scaling: qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 under YaRN."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    sc = cfg.rope_scaling
    if sc is not None and sc.get("mscale_all_dim"):
        scale *= yarn_get_mscale(sc["factor"], sc["mscale_all_dim"]) ** 2
    return scale


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, kvh, S, hd] -> [B, kvh*n_rep, S, hd]; query head h uses kv head h // n_rep."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def make_vocab_map(used_ids: torch.Tensor | list[int], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from the kept target ids: sorted ascending, d2t[i] = used[i] - i."""
    used = torch.as_tensor(used_ids, dtype=torch.int64).sort().values
    if used.numel() and (used[0] < 0 or used[-1] >= vocab_size):
        raise ValueError("make_vocab_map: ids out of [0, vocab_size)")
    if used.numel() != used.unique().numel():
        raise ValueError("make_vocab_map: duplicated ids")
    d2t = used - torch.arange(used.numel(), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


# --------------------------------------------------------------------------------------------------
# Drafter
# --------------------------------------------------------------------------------------------------


class RefDrafter(nn.Module):
    """EAGLE-3 / 3.1 drafter with the EAGLE authors' state-dict layout.

    Cast the whole module with ``.to(dtype)`` for half-precision runs; d2t/t2d keep their dtypes.
    """

    def __init__(self, cfg: RefDrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, V, Vd = cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size
        # The target's embedding, frozen (usually absent from drafter checkpoints).
        self.embed_tokens = nn.Embedding(V, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = _linear(cfg.fc_in, H)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(
                [RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux_hidden_states)]
            )
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(cfg.fc_in, cfg.rms_norm_eps)
        self.midlayer = RefMidLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = _linear(H, Vd)
        # Identity map by default (all-zero offsets; every target id is a draft id when Vd == V).
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.int64))
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[:Vd] = True
        self.register_buffer("t2d", t2d)

    # -- small pieces ------------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @torch.no_grad()
    def random_init_(self, seed: int = 0, used_ids: torch.Tensor | list[int] | None = None) -> "RefDrafter":
        """Deterministic non-trivial weights for parity tests (norm weights != 1 so they are exercised).

        ``used_ids``: kept target ids for the vocab map; default a seeded random subset when Vd < V.
        """
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if p.ndim == 1:  # every RMSNorm weight
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name == "embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # linear [out, in]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
        V, Vd = self.cfg.vocab_size, self.cfg.draft_vocab_size
        if used_ids is None:
            used_ids = torch.randperm(V, generator=g)[:Vd] if Vd < V else torch.arange(V)
        d2t, t2d = make_vocab_map(used_ids, V)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        return self

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft ids -> target ids: d2t holds OFFSETS."""
        return ids + self.d2t[ids]

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """fc over concatenated aux states [B, T, N*Ht] -> [B, T, H], with the optional pre-fc norm."""
        cfg = self.cfg
        if aux.shape[-1] != cfg.fc_in:
            raise ValueError(f"fuse: aux width {aux.shape[-1]} != num_aux*target_hidden_size={cfg.fc_in}")
        if cfg.fc_norm:
            # One RMSNorm per aux chunk (EAGLE-3.1), each of width Ht.
            chunks = aux.split(cfg.target_hidden_size, dim=-1)
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks)], dim=-1)
        elif cfg.norm_before_fc:
            aux = self.input_norm(aux)
        return self.fc(aux)

    def _u(self, g: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        ml = self.midlayer
        e = self.embed_tokens(input_ids).to(g.dtype)
        return torch.cat((ml.input_layernorm(e), ml.hidden_norm(g)), dim=-1)  # EMBEDDING FIRST

    def mla_latents(
        self, g: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA: (normed latents [B, T, kv_lora_rank], rotated shared rope keys [B, T, rope]), what a latent
        cache holds."""
        cfg, at = self.cfg, self.midlayer.self_attn
        kv = at.kv_a_proj_with_mqa(self._u(g, input_ids))
        latent, k_rot = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        cos, sin = rope_cos_sin(cfg, position_ids, g.dtype)
        return at.kv_a_layernorm(latent), apply_rope_interleaved(k_rot[:, None], cos, sin)[:, 0]

    def _mla_qkv(
        self, g: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """MLA, as HF DeepseekV3Attention: q, k [B, heads, T, nope + rope] and v [B, heads, T, v_head_dim]."""
        cfg, at = self.cfg, self.midlayer.self_attn
        B, T, _ = g.shape
        heads, nope, rope = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        u = self._u(g, input_ids)
        if cfg.q_lora_rank is None:
            q = at.q_proj(u)
        else:
            q = at.q_b_proj(at.q_a_layernorm(at.q_a_proj(u)))
        q = q.view(B, T, heads, nope + rope).transpose(1, 2)
        q_pass, q_rot = q.split([nope, rope], dim=-1)
        kv = at.kv_a_proj_with_mqa(u)
        latent, k_rot = kv.split([cfg.kv_lora_rank, rope], dim=-1)
        kv = at.kv_b_proj(at.kv_a_layernorm(latent)).view(B, T, heads, nope + cfg.v_head_dim).transpose(1, 2)
        k_pass, v = kv.split([nope, cfg.v_head_dim], dim=-1)
        cos, sin = rope_cos_sin(cfg, position_ids, g.dtype)
        q_rot = apply_rope_interleaved(q_rot, cos, sin)
        k_rot = apply_rope_interleaved(k_rot.view(B, 1, T, rope), cos, sin).expand(B, heads, T, rope)
        return torch.cat((q_pass, q_rot), dim=-1), torch.cat((k_pass, k_rot), dim=-1), v

    def scaled(self, dots: torch.Tensor) -> torch.Tensor:
        """q.k dot products -> attention scores (model dtype): / sqrt(head_dim), or times MLA's softmax scale."""
        if self.cfg.mla:
            return dots * mla_softmax_scale(self.cfg)
        return dots / math.sqrt(self.cfg.head_dim)

    def _qkv(
        self, g: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, heads, T, hd], k/v [B, kv_heads, T, hd] (q and k rotated) for pairs (g_t, x_{t+1})."""
        cfg, ml = self.cfg, self.midlayer
        if cfg.mla:
            return self._mla_qkv(g, input_ids, position_ids)
        B, T, _ = g.shape
        u = self._u(g, input_ids)
        at = ml.self_attn
        q = at.q_proj(u).view(B, T, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = at.k_proj(u).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = at.v_proj(u).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(cfg, position_ids, g.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _finish(self, g: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """attn [B, heads, T, hd] -> (logits, h2, normed). The residual is the UN-normed g."""
        B, _, T, _ = attn.shape
        ml = self.midlayer
        h1 = g + ml.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        h2 = h1 + ml.mlp(ml.post_attention_layernorm(h1))
        normed = self.norm(h2)
        return self.lm_head(normed), h2, normed

    def next_feature(self, h2: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """EAGLE-3 feeds pre-norm h2 forward; EAGLE-3.1 ``norm_output`` feeds RMSNorm_final(h2)."""
        return normed if self.cfg.norm_output else h2

    # -- public forward passes ---------------------------------------------------------------------

    def step(
        self,
        g: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        past_kv: KV | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, KV]:
        """One decoder-layer pass over a block of T (feature, token) pairs.

        g: [B, T, H] features (already fused / drafter-produced); input_ids: [B, T] the token paired
        with each feature (x_{t+1}); position_ids: [B, T]; past_kv: (k, v) [B, kvh, P, hd] or None;
        attn_mask: bool [B, T, P+T], True = may attend (default: causal, query t sees keys <= P+t).
        Returns (logits [B, T, Vd], next_feature [B, T, H], new_past_kv with P+T keys).
        """
        cfg = self.cfg
        B, T, _ = g.shape
        q, k, v = self._qkv(g, input_ids, position_ids)
        if past_kv is not None:
            k = torch.cat((past_kv[0], k), dim=2)
            v = torch.cat((past_kv[1], v), dim=2)
        S = k.shape[2]
        P = S - T
        if attn_mask is None:
            qi = torch.arange(T, device=g.device)[:, None] + P
            attn_mask = (torch.arange(S, device=g.device)[None, :] <= qi)[None].expand(B, T, S)
        if attn_mask.shape != (B, T, S):
            raise ValueError(f"step: attn_mask shape {tuple(attn_mask.shape)} != {(B, T, S)}")
        n_rep = cfg.num_attention_heads // cfg.num_key_value_heads
        kr, vr = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        scores = self.scaled(torch.matmul(q, kr.transpose(2, 3)))  # model dtype
        scores = scores.to(torch.float32).masked_fill(~attn_mask[:, None], torch.finfo(torch.float32).min)
        probs = scores.softmax(dim=-1).to(q.dtype)  # fp32 softmax, cast back
        logits, h2, normed = self._finish(g, torch.matmul(probs, vr))
        return logits, self.next_feature(h2, normed), (k, v)

    def forward(
        self, features: torch.Tensor, input_ids: torch.Tensor, fused: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole sequence at positions 0..T-1, causal, no cache.

        features: [B, T, N*Ht] target aux states (go through ``fuse``) or [B, T, H] drafter features
        (used directly); ``fused`` overrides the width-based choice (needed only if N*Ht == H).
        input_ids[:, t] is the token paired with features[:, t] (already shifted by the caller).
        Returns (logits [B, T, Vd], next_features [B, T, H]).
        """
        if fused is None:
            w = features.shape[-1]
            if w == self.cfg.fc_in:
                fused = False
            elif w == self.cfg.hidden_size:
                fused = True
            else:
                raise ValueError(f"forward: feature width {w} is neither N*Ht={self.cfg.fc_in} nor H")
        g = features if fused else self.fuse(features)
        B, T = input_ids.shape
        pos = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        logits, nxt, _ = self.step(g, input_ids, pos)
        return logits, nxt


# --------------------------------------------------------------------------------------------------
# Checkpoint loading (strict)
# --------------------------------------------------------------------------------------------------


def _normalize_keys(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map accepted key variants onto the authors' layout."""
    out: dict[str, torch.Tensor] = {}
    for key, val in sd.items():
        k = key
        if k.startswith("model."):  # `model.` prefix on every key but lm_head
            k = k[len("model.") :]
        if k.startswith("layers.0."):
            k = "midlayer." + k[len("layers.0.") :]
        if k == "draft_id_to_target_id":
            k = "d2t"
        if k in out:
            raise ValueError(f"checkpoint: key {key!r} collides with another key after normalisation to {k!r}")
        out[k] = val
    return out


def load_eagle_state_dict(
    model: RefDrafter, sd: Mapping[str, torch.Tensor], embed: torch.Tensor | None = None
) -> RefDrafter:
    """Strictly load an EAGLE drafter checkpoint into ``model``.

    Allowed absences: ``embed_tokens.weight`` (then ``embed`` [V, H] must be given; if both exist,
    ``embed`` wins), d2t/t2d when draft_vocab_size == vocab_size (identity), t2d alone (derived from
    d2t). Any other missing key, any unexpected key or shape mismatch raises. d2t is validated:
    targets inside [0, V) and strictly increasing; a given t2d must agree with it.
    """
    cfg = model.cfg
    V, Vd = cfg.vocab_size, cfg.draft_vocab_size
    sd = _normalize_keys(sd)
    expected = set(model.state_dict().keys())
    unexpected = sorted(set(sd) - expected)
    if unexpected:
        raise ValueError(f"checkpoint: unexpected keys {unexpected}")

    if "d2t" not in sd:
        if "t2d" in sd:
            raise ValueError("checkpoint: 't2d' present but 'd2t' missing")
        if Vd != V:
            # Never invent a mapping (a silent 'first Vd ids' default collapses acceptance).
            raise ValueError(f"checkpoint: 'd2t' missing although draft_vocab_size={Vd} != vocab_size={V}")
        sd["d2t"] = torch.zeros(Vd, dtype=torch.int64)
    d2t = sd["d2t"].to(torch.int64)
    if d2t.shape != (Vd,):
        raise ValueError(f"checkpoint: 'd2t' shape {tuple(d2t.shape)} != ({Vd},)")
    tgt = torch.arange(Vd, dtype=torch.int64) + d2t
    if Vd and (tgt.min() < 0 or tgt.max() >= V):
        raise ValueError(f"checkpoint: 'd2t' maps draft ids outside [0, {V})")
    if Vd > 1 and not bool((tgt[1:] > tgt[:-1]).all()):
        raise ValueError("checkpoint: 'd2t' target ids are not strictly increasing")
    derived = torch.zeros(V, dtype=torch.bool)
    derived[tgt] = True
    if "t2d" in sd:
        t2d = sd["t2d"].to(torch.bool)
        if t2d.shape != (V,) or not torch.equal(t2d, derived):
            raise ValueError("checkpoint: 't2d' disagrees with 'd2t'")
    sd["d2t"], sd["t2d"] = d2t, derived

    if "embed_tokens.weight" not in sd:
        if embed is None:
            raise ValueError("checkpoint: 'embed_tokens.weight' absent and no target embedding given")
        sd["embed_tokens.weight"] = embed
    elif embed is not None:
        sd["embed_tokens.weight"] = embed  # the target's embedding is authoritative

    missing = sorted(expected - set(sd))
    if missing:
        raise ValueError(f"checkpoint: missing keys {missing}")
    model.load_state_dict(sd, strict=True)  # raises on shape mismatch too
    return model


# --------------------------------------------------------------------------------------------------
# TTT (training-time test)
# --------------------------------------------------------------------------------------------------


def shift_left(x: torch.Tensor) -> torch.Tensor:
    """Shift along the time axis (dim 1) left by one, zero-padding the end (tokens 0, mask 0, logits 0)."""
    return torch.cat((x[:, 1:], torch.zeros_like(x[:, :1])), dim=1)


def ttt_unroll(
    model: RefDrafter, aux: torch.Tensor, input_ids: torch.Tensor, ttt_length: int = 7
) -> list[torch.Tensor]:
    """Run the TTT unroll and return each step's draft logits [B, T, Vd] (in the model dtype).

    Index j of step i predicts token j+i+2 from: target features 0..j (step-0 keys) and the
    drafter's own features of steps 1..i at index j (diagonal keys), at RoPE position j+i.
    """
    cfg = model.cfg
    B, T = input_ids.shape
    n_rep = cfg.num_attention_heads // cfg.num_key_value_heads
    pos = torch.arange(T)[None].expand(B, T)
    causal = torch.arange(T)[None, :] <= torch.arange(T)[:, None]  # [Tq, Tk]: key k <= query j

    # Pair feature_t with token_{t+1}: shift tokens left once before the first step.
    tokens = shift_left(input_ids)
    g = model.fuse(aux)
    k0 = v0 = None
    diag_k: list[torch.Tensor] = []  # steps 1..i, each [B, heads, T, hd] (kv repeated)
    diag_v: list[torch.Tensor] = []
    all_logits: list[torch.Tensor] = []
    for i in range(ttt_length):
        q, k, v = model._qkv(g, tokens, pos + i)  # step i sits i positions further along
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        if i == 0:
            k0, v0 = k, v
        else:
            diag_k.append(k)
            diag_v.append(v)
        # Scores vs step-0 keys, causal: [B, h, T, T].
        s0 = model.scaled(torch.matmul(q, k0.transpose(2, 3)))
        # Scores vs each later step's key at the SAME index j (the diagonal): [B, h, T, 1] each.
        sd = [model.scaled((q * kd).sum(-1))[..., None] for kd in diag_k]
        s0 = s0.to(torch.float32).masked_fill(~causal, torch.finfo(torch.float32).min)
        scores = torch.cat([s0] + [s.to(torch.float32) for s in sd], dim=-1)
        probs = scores.softmax(dim=-1).to(q.dtype)  # ONE fp32 softmax over T + i columns
        out = torch.matmul(probs[..., :T], v0)
        for s, vd in enumerate(diag_v):
            out = out + probs[..., T + s : T + s + 1] * vd
        logits, h2, normed = model._finish(g, out)
        all_logits.append(logits)
        # Feed this step's feature forward at the same index, and move the token one further.
        g = model.next_feature(h2, normed)
        tokens = shift_left(tokens)
    return all_logits


def ttt_loss(
    model: RefDrafter,
    aux: torch.Tensor,
    input_ids: torch.Tensor,
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    ttt_length: int = 7,
    decay: float = 0.8,
    normalize: str = "all",
    acc_denominator: str = "mask",
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The TTT loss.

    aux [B, T, N*Ht]; input_ids [B, T]; target_logits [B, T, V] (target position t predicts token
    t+1); loss_mask [B, T] (1 on tokens to learn, e.g. assistant tokens, aligned with input_ids).
    normalize: "all" divides each step's sum by B*T (EAGLE reference), "valid" by max(sum(mask_i), 1)
    (TorchSpec). Accuracy per step = argmax agreement in draft-id space over positions with
    mask_i == 1, divided by sum(mask_i) ("mask") or by sum(shifted loss_mask) ("loss_mask", as the
    EAGLE reference reports it: positions whose target argmax is outside the draft vocab count wrong).
    Returns (total = sum_i decay^i * l_i, [l_i], [acc_i]) with 0-dim fp32 tensors.
    """
    if normalize not in ("all", "valid"):
        raise ValueError(f"ttt_loss: normalize must be 'all' or 'valid', got {normalize!r}")
    if acc_denominator not in ("mask", "loss_mask"):
        raise ValueError(f"ttt_loss: acc_denominator must be 'mask' or 'loss_mask', got {acc_denominator!r}")
    B, T = input_ids.shape
    t2d = model.t2d
    all_logits = ttt_unroll(model, aux, input_ids, ttt_length)

    # Position t pairs (feature_t, token_{t+1}) and is supervised by the target's distribution for
    # token_{t+2}, i.e. target_logits[t+1]. TTT shifts targets AND loss mask by one together
    # with the tokens (ttt_unroll shifts the tokens), so after this: target[t] = target_logits[t+1],
    # lmask[t] = loss_mask[t+1], zero-padded at the end.
    target = shift_left(target_logits.to(torch.float32))
    lmask = shift_left(loss_mask.to(torch.float32))
    total = torch.zeros((), dtype=torch.float32)
    losses: list[torch.Tensor] = []
    accs: list[torch.Tensor] = []
    for i, logits in enumerate(all_logits):
        with torch.no_grad():
            in_draft = t2d[target.argmax(-1)].to(torch.float32)  # target's top token is draftable
            mask = lmask * in_draft  # [B, T]
            p = target[..., t2d].softmax(-1)  # fp32, restricted to the draft vocab (draft-id order)
        logq = logits.to(torch.float32).log_softmax(-1)
        per_pos = -(p * logq).sum(-1)  # cross-entropy against the soft target, [B, T]
        denom = float(B * T) if normalize == "all" else mask.sum().clamp_min(1.0)
        l_i = (mask * per_pos).sum() / denom
        losses.append(l_i)
        total = total + (decay**i) * l_i
        with torch.no_grad():
            correct = (logits.argmax(-1) == p.argmax(-1)).to(torch.float32)
            acc_den = mask.sum() if acc_denominator == "mask" else lmask.sum()
            accs.append((correct * mask).sum() / acc_den.clamp_min(1.0))
        # Next step predicts one token further: shift targets and mask left again (zero-pad).
        target = shift_left(target)
        lmask = shift_left(lmask)
    return total, losses, accs
