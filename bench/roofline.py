"""Roofline counting model: model FLOPs and bytes moved by prefill, decoding rounds and verification,
and the machine's matmul peak and read bandwidth measured in the same run.

What is counted (a model of the useful work, not of what a given compiler emits):

- **FLOPs**: 2 x the matmul weights each token multiplies with (every projection, MLP and lm_head; of a
  mixture of experts only the ``num_experts_per_tok`` activated routed experts plus the shared experts
  and the router), plus attention: scores and value products of every query over the keys it may see
  (the row's context plus its own block, causal). MLA decoding and verification are counted in the
  absorbed form the engine runs (scores against the ``kv_lora_rank`` latents and the shared rope key;
  W_UK / W_UV count as ``kv_b_proj`` weights per query token), MLA prefill in the expanded form.
  Norms, RoPE, softmax, sampling and tree bookkeeping are not counted.
- **Bytes**: every matmul weight a forward touches, read once per forward (of an MoE layer the routed
  experts at least one of the forward's B x T tokens activates, in expectation under uniform routing:
  E x (1 - (1 - k/E)^(B T))), the embedding rows looked up, the KV cache each row reads (its context
  only: ``2 x kv_heads x head_dim`` numbers per token and layer for GQA, ``kv_lora_rank +
  qk_rope_head_dim`` for MLA's latent cache) and the cache entries written. Activations and logits
  are not counted (they stay in caches or are small next to the weights at these shapes).
- **A decoding round**: plain = one target forward of 1 position (lm_head on it). Chain K = K-1
  single-token drafter steps (layer + draft lm_head), one target verification of K+1 positions
  (lm_head on all of them) and the drafter's extension over the K+1 accepted-or-not positions (fc +
  layer, lm_head at one position). Tree (top_k k, depth d, N nodes) = d-1 drafter expansions of k
  nodes, a verification of N positions, the accepted path's KV moved to contiguous slots (read +
  write of d+1 entries per layer) and the extension over d+1 positions.
- **Per generated token**: the rounds' cost over the tokens they emitted (measured: rounds x batch
  rows are computed whatever their state, divided by the tokens actually emitted).

``time_at_peak_flops`` = FLOPs / measured matmul peak, ``time_at_peak_bytes`` = bytes / measured read
bandwidth; the larger names the bound, and ``roofline_fraction`` = that time x the achieved rate
(1.0: running at the roofline).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np

from eagle_jax.config import DrafterConfig, SpecConfig, TargetConfig

# ------------------------------------------------------------------------------------------ costs


@dataclass(frozen=True)
class Cost:
    """FLOPs and bytes of some work; bytes split into weights, KV-cache reads and KV-cache writes."""

    flops: float = 0.0
    weight_bytes: float = 0.0
    kv_read_bytes: float = 0.0
    kv_write_bytes: float = 0.0

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(
            self.flops + other.flops,
            self.weight_bytes + other.weight_bytes,
            self.kv_read_bytes + other.kv_read_bytes,
            self.kv_write_bytes + other.kv_write_bytes,
        )

    def scale(self, f: float) -> "Cost":
        return Cost(self.flops * f, self.weight_bytes * f, self.kv_read_bytes * f, self.kv_write_bytes * f)

    def to_dict(self) -> dict:
        return {**asdict(self), "bytes": self.bytes}


# --------------------------------------------------------------------------------- parameter counts


def _gqa_params(d_in: int, d_out: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """q, k, v, o projections of GQA attention (biases ignored)."""
    return d_in * heads * head_dim + 2 * d_in * kv_heads * head_dim + heads * head_dim * d_out


def _mla_params(d_in: int, d_out: int, heads: int, mla) -> int:
    """q (direct or low-rank), kv_a (latent + rope key), kv_b (W_UK and W_UV), o."""
    qk = heads * mla.qk_head_dim
    q = d_in * qk if mla.q_lora_rank is None else d_in * mla.q_lora_rank + mla.q_lora_rank * qk
    kv_a = d_in * (mla.kv_lora_rank + mla.qk_rope_head_dim)
    kv_b = mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    return q + kv_a + kv_b + heads * mla.v_head_dim * d_out


@dataclass(frozen=True)
class TargetParams:
    """Matmul weights of a target (numbers, not bytes).

    ``dense``: weights every token multiplies with in the decoder stack (attention, dense MLPs, shared
    experts, routers); ``expert``: one routed expert's SwiGLU; ``moe_layers``: layers with routed
    experts; ``experts`` / ``active``: routed experts per layer and activated per token; ``lm_head``:
    V x H (the embedding when tied); ``embed``: the input embedding (looked up, not multiplied)."""

    dense: int
    expert: int
    moe_layers: int
    experts: int
    active: int
    lm_head: int
    embed: int

    @property
    def per_token(self) -> float:
        """Weights one token multiplies with: the stack (activated experts only) plus the lm_head."""
        return self.dense + self.moe_layers * self.active * self.expert + self.lm_head

    @property
    def total(self) -> int:
        """Every matmul weight, all experts (the lm_head once even when tied)."""
        return self.dense + self.moe_layers * self.experts * self.expert + self.lm_head

    def touched_experts(self, tokens: float) -> float:
        """Expected routed experts per MoE layer that at least one of ``tokens`` tokens activates
        (uniform routing)."""
        if self.moe_layers == 0:
            return 0.0
        return self.experts * (1.0 - (1.0 - self.active / self.experts) ** tokens)


def target_params(c: TargetConfig) -> TargetParams:
    h = c.hidden_size
    if c.mla is not None:
        attn = _mla_params(h, h, c.num_heads, c.mla)
    else:
        attn = _gqa_params(h, h, c.num_heads, c.num_kv_heads, c.head_dim)
    dense_mlp = 3 * h * c.intermediate_size
    dense, moe_layers, expert, experts, active = 0, 0, 0, 0, 0
    for i in range(c.num_layers):
        dense += attn
        if c.moe is not None and c.moe.is_moe_layer(i):
            m = c.moe
            moe_layers += 1
            expert, experts, active = 3 * h * m.moe_intermediate_size, m.n_routed_experts, m.num_experts_per_tok
            dense += 3 * h * m.moe_intermediate_size * m.n_shared_experts + m.n_routed_experts * h  # shared + router
        else:
            dense += dense_mlp
    return TargetParams(dense, expert, moe_layers, experts, active, c.vocab_size * h, c.vocab_size * h)


@dataclass(frozen=True)
class DrafterParams:
    """Matmul weights of a drafter: ``fc`` (N x Ht -> H), ``layer`` (attention over the 2H input +
    MLP), ``lm_head`` (H -> draft vocabulary); ``embed``: the (target's) embedding it looks up."""

    fc: int
    layer: int
    lm_head: int
    embed: int


def drafter_params(d: DrafterConfig) -> DrafterParams:
    h = d.hidden_size
    if d.mla is not None:
        attn = _mla_params(2 * h, h, d.num_heads, d.mla)
    else:
        attn = _gqa_params(2 * h, h, d.num_heads, d.num_kv_heads, d.head_dim)
    return DrafterParams(
        d.fc_in_features * h, attn + 3 * h * d.intermediate_size, h * d.draft_vocab_size, d.vocab_size * h
    )


# ------------------------------------------------------------------------------------ KV and attention


def kv_numbers_per_token(c: TargetConfig | DrafterConfig, layers: int) -> int:
    """Cached numbers per token over ``layers`` layers: 2 x kv_heads x head_dim (GQA) or kv_lora_rank +
    qk_rope_head_dim (MLA latent cache)."""
    if c.mla is not None:
        return layers * (c.mla.kv_lora_rank + c.mla.qk_rope_head_dim)
    return layers * 2 * c.num_kv_heads * c.head_dim


def attention_flops_per_pair(c: TargetConfig | DrafterConfig, absorbed: bool) -> int:
    """FLOPs of one (query, key) pair over all heads of one layer: scores + value product.

    GQA: 2 x heads x (head_dim + head_dim). MLA absorbed (cached decoding): 2 x heads x (kv_lora_rank +
    rope) for the scores against latent + rope key, 2 x heads x kv_lora_rank for the latent average.
    MLA expanded (prefill): 2 x heads x (qk_head_dim + v_head_dim)."""
    if c.mla is None:
        return 4 * c.num_heads * c.head_dim
    m = c.mla
    if absorbed:
        return 2 * c.num_heads * (m.kv_lora_rank + m.qk_rope_head_dim) + 2 * c.num_heads * m.kv_lora_rank
    return 2 * c.num_heads * (m.qk_head_dim + m.v_head_dim)


# ------------------------------------------------------------------------------------------ forwards


def target_forward(
    c: TargetConfig,
    batch: int,
    width: int,
    context: float,
    *,
    weight_bytes: int,
    cache_bytes: int,
    logit_positions: int | None = None,
    block_keys: float | None = None,
) -> Cost:
    """One cached target forward of ``width`` new positions per row over ``context`` cached tokens.

    Each query sees ``context + block_keys`` keys (default (width+1)/2: causal within the block; a tree
    node sees its ancestors). ``logit_positions`` per row go through the lm_head (default: all)."""
    p = target_params(c)
    tokens = batch * width
    lp = width if logit_positions is None else logit_positions
    keys = context + ((width + 1) / 2 if block_keys is None else block_keys)
    stack = p.dense + p.moe_layers * p.active * p.expert
    flops = (
        2 * tokens * stack
        + 2 * batch * lp * p.lm_head
        + tokens * keys * c.num_layers * attention_flops_per_pair(c, True)
    )
    weights = (p.dense + p.moe_layers * p.touched_experts(tokens) * p.expert + p.lm_head) * weight_bytes
    weights += tokens * c.hidden_size * weight_bytes  # embedding rows
    kv = kv_numbers_per_token(c, c.num_layers) * cache_bytes
    return Cost(flops, weights, batch * context * kv, tokens * kv)


def target_prefill(c: TargetConfig, batch: int, prompt_len: int, *, weight_bytes: int, cache_bytes: int) -> Cost:
    """The prompt's forward from an empty cache: ``prompt_len`` positions per row, causal self-attention
    (P(P+1)/2 pairs; MLA expanded), the lm_head at the last position only, the cache written."""
    p = target_params(c)
    tokens = batch * prompt_len
    pairs = batch * prompt_len * (prompt_len + 1) / 2
    stack = p.dense + p.moe_layers * p.active * p.expert
    flops = 2 * tokens * stack + 2 * batch * p.lm_head + pairs * c.num_layers * attention_flops_per_pair(c, False)
    weights = (p.dense + p.moe_layers * p.touched_experts(tokens) * p.expert + p.lm_head) * weight_bytes
    weights += tokens * c.hidden_size * weight_bytes
    return Cost(flops, weights, 0.0, tokens * kv_numbers_per_token(c, c.num_layers) * cache_bytes)


def drafter_forward(
    d: DrafterConfig,
    batch: int,
    width: int,
    context: float,
    *,
    weight_bytes: int,
    cache_bytes: int,
    fuse: bool = False,
    logit_positions: int | None = None,
    block_keys: float | None = None,
) -> Cost:
    """One cached drafter forward of ``width`` (feature, token) pairs per row over ``context`` cached
    tokens: fc over the target features when ``fuse``, the decoder layer, the draft lm_head at
    ``logit_positions`` per row (default all)."""
    p = drafter_params(d)
    tokens = batch * width
    lp = width if logit_positions is None else logit_positions
    keys = context + ((width + 1) / 2 if block_keys is None else block_keys)
    fc = p.fc if fuse else 0
    flops = 2 * tokens * (fc + p.layer) + 2 * batch * lp * p.lm_head + tokens * keys * attention_flops_per_pair(d, True)
    weights = (fc + p.layer + p.lm_head + tokens * d.hidden_size) * weight_bytes
    kv = kv_numbers_per_token(d, 1) * cache_bytes
    return Cost(flops, weights, batch * context * kv, tokens * kv)


def drafter_prefill(d: DrafterConfig, batch: int, prompt_len: int, *, weight_bytes: int, cache_bytes: int) -> Cost:
    """The drafter over the prompt's target features, as the engine runs it (``decoding/prefill.py``): fc and the
    key/value projections of the 2H input on every position (a pair's cache entry needs only its own), the rest of
    the layer, its attention over the prompt and the lm_head at the last position only."""
    p = drafter_params(d)
    tokens = batch * prompt_len
    kv_weights = (
        2 * d.hidden_size * kv_numbers_per_token(d, 1)
    )  # the 2H input to the cached keys and values (MLA: latents)
    flops = 2 * tokens * (p.fc + kv_weights) + 2 * batch * (p.layer - kv_weights + p.lm_head)
    flops += batch * prompt_len * attention_flops_per_pair(d, False)
    weights = (p.fc + p.layer + p.lm_head + tokens * d.hidden_size) * weight_bytes
    return Cost(flops, weights, 0.0, tokens * kv_numbers_per_token(d, 1) * cache_bytes)


def prefill(
    c: TargetConfig, d: DrafterConfig | None, batch: int, prompt_len: int, *, weight_bytes: int, cache_bytes: int
) -> Cost:
    """Target prefill plus, with a drafter, its prefill over the same positions."""
    cost = target_prefill(c, batch, prompt_len, weight_bytes=weight_bytes, cache_bytes=cache_bytes)
    if d is not None:
        cost = cost + drafter_prefill(d, batch, prompt_len, weight_bytes=weight_bytes, cache_bytes=cache_bytes)
    return cost


def decode_round(
    c: TargetConfig,
    d: DrafterConfig | None,
    spec: SpecConfig | None,
    batch: int,
    context: float,
    *,
    weight_bytes: int,
    cache_bytes: int,
) -> Cost:
    """One round of the decoding loop for ``batch`` rows at committed length ``context`` (see the module
    docstring for what plain, chain and tree rounds run). ``cache_bytes`` applies to target and drafter
    caches alike."""
    kw = dict(weight_bytes=weight_bytes, cache_bytes=cache_bytes)
    if spec is None or d is None:
        return target_forward(c, batch, 1, context, **kw)
    if spec.method == "chain":
        k = spec.num_speculative_tokens
        cost = Cost()
        for i in range(k - 1):  # drafts 1..K-1 (draft 0 comes from the last round's extension)
            cost = cost + drafter_forward(d, batch, 1, context + i, logit_positions=1, **kw)
        cost = cost + target_forward(c, batch, k + 1, context, **kw)
        return cost + drafter_forward(d, batch, k + 1, context, fuse=True, logit_positions=1, **kw)
    k, depth, n = spec.tree_top_k, spec.tree_depth, spec.tree_total_tokens
    cost = Cost()
    for e in range(depth - 1):  # each expansion: k frontier nodes, each seeing the prefix + its e+1 ancestors
        cost = cost + drafter_forward(d, batch, k, context, block_keys=e + 1, **kw)
    # A tree node sees the prefix plus its ancestors: about half the depth on average.
    cost = cost + target_forward(c, batch, n, context, block_keys=1 + depth / 2, **kw)
    move = batch * (depth + 1) * kv_numbers_per_token(c, c.num_layers) * cache_bytes
    cost = cost + Cost(0.0, 0.0, move, move)  # the accepted path gathered into contiguous slots
    return cost + drafter_forward(d, batch, depth + 1, context, fuse=True, logit_positions=1, **kw)


def per_generated_token(
    c: TargetConfig,
    d: DrafterConfig | None,
    spec: SpecConfig | None,
    batch: int,
    prompt_len: float,
    new_tokens: float,
    rounds: float | None = None,
    acceptance_length: float | None = None,
    *,
    weight_bytes: int,
    cache_bytes: int,
) -> Cost:
    """Cost per generated token of the decoding loop (prefill excluded).

    ``new_tokens``: tokens the loop emitted over all rows (the prefill's first token per row excluded).
    ``rounds``: rounds the loop ran (each computes all ``batch`` rows); without it, rounds =
    new_tokens / (batch x acceptance_length). The attention context is the mean committed length over
    the loop: prompt_len + 1 + new_tokens / batch / 2 (attention costs are linear in it)."""
    if rounds is None:
        al = 1.0 if (spec is None or acceptance_length is None) else acceptance_length
        rounds = new_tokens / (batch * al)
    context = prompt_len + 1 + new_tokens / batch / 2
    r = decode_round(c, d, spec, batch, context, weight_bytes=weight_bytes, cache_bytes=cache_bytes)
    return r.scale(rounds / max(new_tokens, 1e-9))


# ------------------------------------------------------------------------------------------ roofline


def roofline(cost_per_token: Cost, tokens_per_s: float, peaks: dict) -> dict:
    """Achieved rates and fractions of the measured peaks for work of ``cost_per_token`` done at
    ``tokens_per_s``; ``peaks``: ``matmul_flops`` (FLOP/s) and ``read_bytes_per_s``."""
    f, b = cost_per_token.flops, cost_per_token.bytes
    t_f, t_b = f / peaks["matmul_flops"], b / peaks["read_bytes_per_s"]
    return {
        "flops_per_token": f,
        "bytes_per_token": b,
        "weight_bytes_per_token": cost_per_token.weight_bytes,
        "kv_bytes_per_token": cost_per_token.kv_read_bytes + cost_per_token.kv_write_bytes,
        "arithmetic_intensity": f / b if b else float("inf"),
        "achieved_flops": f * tokens_per_s,
        "achieved_bytes_per_s": b * tokens_per_s,
        "flops_fraction": f * tokens_per_s / peaks["matmul_flops"],
        "bytes_fraction": b * tokens_per_s / peaks["read_bytes_per_s"],
        "time_at_peak_flops": t_f,
        "time_at_peak_bytes": t_b,
        "bound": "compute" if t_f > t_b else "memory",
        "roofline_fraction": max(t_f, t_b) * tokens_per_s,
    }


def decode_columns(
    target_config: TargetConfig,
    drafter_config: DrafterConfig | None,
    spec: SpecConfig | None,
    *,
    batch: int,
    prompt_len: float,
    new_tokens: int,
    rounds: int | None,
    decode_s: float,
    acceptance_length: float | None,
    peaks: dict,
    weight_bytes: int,
    cache_bytes: int,
) -> dict:
    """The roofline columns of one decoding row: model cost per generated token (``per_generated_token``)
    at the measured decode rate ``new_tokens / decode_s``."""
    cost = per_generated_token(
        target_config,
        drafter_config,
        spec,
        batch,
        prompt_len,
        new_tokens,
        rounds,
        acceptance_length,
        weight_bytes=weight_bytes,
        cache_bytes=cache_bytes,
    )
    tps = new_tokens / decode_s if decode_s > 0 else float("nan")
    return {"decode_tokens_per_s": tps, **roofline(cost, tps, peaks)}


def prefill_columns(
    target_config: TargetConfig,
    drafter_config: DrafterConfig | None,
    *,
    batch: int,
    prompt_len: int,
    prefill_s: float,
    peaks: dict,
    weight_bytes: int,
    cache_bytes: int,
) -> dict:
    """The roofline columns of a prefill: cost per prompt token (``prefill``) at batch x prompt_len /
    prefill_s prompt tokens per second. ``prompt_len``: the positions computed (the padded bucket)."""
    cost = prefill(target_config, drafter_config, batch, prompt_len, weight_bytes=weight_bytes, cache_bytes=cache_bytes)
    tokens = batch * prompt_len
    tps = tokens / prefill_s if prefill_s > 0 else float("nan")
    return {"prefill_tokens_per_s": tps, "prefill_s": prefill_s, **roofline(cost.scale(1 / tokens), tps, peaks)}


# ------------------------------------------------------------------------------------- measured peaks


def _best_seconds(fn, args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def measure_matmul_peak(dtype="float32", n: int | None = None, chain: int = 4, repeats: int = 7) -> float:
    """FLOP/s of ``chain`` dependent n x n x n matmuls in one jitted loop, best of ``repeats``
    (n = 1024 on CPU, 4096 on accelerators)."""
    import jax
    import jax.numpy as jnp

    n = n or (1024 if jax.default_backend() == "cpu" else 4096)
    x = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    w = (jax.random.normal(jax.random.key(1), (n, n), jnp.float32) / math.sqrt(n)).astype(dtype)
    f = jax.jit(lambda x, w: jax.lax.fori_loop(0, chain, lambda i, a: a @ w, x))
    return 2 * n**3 * chain / _best_seconds(f, (x, w), repeats)


def measure_read_bandwidth(megabytes: int = 256, repeats: int = 7) -> float:
    """Bytes/s of a jitted fp32 max-reduction over a ``megabytes`` MB array, best of ``repeats``."""
    import jax
    import jax.numpy as jnp

    n = megabytes * 2**20 // 4
    x = jnp.ones((1024, n // 1024), jnp.float32)
    f = jax.jit(lambda x: jnp.max(x, axis=1))
    seconds = _best_seconds(f, (x,), repeats)
    del x
    return n * 4 / seconds


def measure_peaks(dtype="float32", matmul_n: int | None = None, read_mb: int = 256) -> dict:
    """{'matmul_flops', 'read_bytes_per_s', 'matmul_dtype', 'backend'} measured now, on this machine."""
    import jax

    return {
        "matmul_flops": measure_matmul_peak(dtype, matmul_n),
        "read_bytes_per_s": measure_read_bandwidth(read_mb),
        "matmul_dtype": str(np.dtype(dtype)) if dtype != "bfloat16" else "bfloat16",
        "backend": jax.default_backend(),
    }


def format_peaks(peaks: dict) -> str:
    return (
        f"measured peaks ({peaks['backend']}): matmul {peaks['matmul_flops'] / 1e9:.1f} GFLOP/s "
        f"({peaks['matmul_dtype']}), read {peaks['read_bytes_per_s'] / 1e9:.1f} GB/s"
    )


# ------------------------------------------------------------------------------------------ table cells

ROOFLINE_HEADER = ["MFLOP/tok", "MB/tok", "GFLOP/s", "% peak", "GB/s", "% BW", "bound", "% roofline"]


def roofline_cells(r: dict) -> list[str]:
    """Table cells for ``ROOFLINE_HEADER`` from a ``roofline`` dict."""
    return [
        f"{r['flops_per_token'] / 1e6:.1f}",
        f"{r['bytes_per_token'] / 1e6:.2f}",
        f"{r['achieved_flops'] / 1e9:.2f}",
        f"{100 * r['flops_fraction']:.1f}",
        f"{r['achieved_bytes_per_s'] / 1e9:.2f}",
        f"{100 * r['bytes_fraction']:.1f}",
        r["bound"],
        f"{100 * r['roofline_fraction']:.0f}",
    ]
