"""Building blocks shared by targets and drafters: RMSNorm, linear layers, RoPE variants, GQA attention, MLP.

Numerics follow the PyTorch reference so that half-precision outputs match bit for bit where
possible: RMSNorm in fp32, cast back, THEN times weight; softmax in fp32 then cast back; cos/sin
built in fp32 and cast to the activation dtype; residual adds in the model dtype.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from eagle_jax.config import RopeConfig

Array = jax.Array


class Frozen(nnx.Variable):
    """A weight that is never trained (the drafter's copy of the target embedding, d2t/t2d maps)."""


class RMSNorm(nnx.Module):
    """Llama: ``weight * normed`` with normed cast back first. ``unit_offset`` (Gemma): ``(1 + weight) * normed``
    in float32, then cast, as Gemma's reference does (its weight is stored as the offset from 1)."""

    def __init__(self, dim: int, eps: float, *, unit_offset: bool = False, dtype=jnp.float32):
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nnx.Param(jnp.zeros((dim,), dtype) if unit_offset else jnp.ones((dim,), dtype))

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * normed.astype(x.dtype)


# ------------------------------------------------------------------------------- weight storage dtype
#
# XLA's CPU backend has no half-precision arithmetic: it widens the operands of every bf16/f16 dot
# (and elementwise op, and a gather's table) to float32. Inside the decoding while_loop a weight's
# widening is loop-invariant, so XLA hoists it out of the loop: the program holds a float32 copy of
# every weight as temporaries (BENCHMARKS.md, "Real size without weights (bench.scale)") and re-widens
# them on every call. So, on the CPU backend only, weight matrices (Linear kernels, the
# target's embedding) requested in bf16/f16 are stored as float32 holding exactly the bf16/f16 values
# (rounded first, at init and at load): XLA runs the same float32 dots over the same numbers, while
# activations, caches, ``module.dtype`` and saved checkpoints stay in the requested dtype. GPU/TPU
# keep half-precision weights (native matmuls; traced programs unchanged). Override:
# ``EAGLE_JAX_WIDEN_HALF_WEIGHTS=0|1``, or ``with half_weights_widened(False|True):`` around building
# or loading the model.

_WIDEN: bool | None = None


def widen_half_weights() -> bool:
    """Whether half-precision weight matrices are stored as float32 (default: on the CPU backend)."""
    if _WIDEN is not None:
        return _WIDEN
    env = os.environ.get("EAGLE_JAX_WIDEN_HALF_WEIGHTS", "")
    if env:
        return env.lower() not in ("0", "false", "no", "off")
    return jax.default_backend() == "cpu"


@contextlib.contextmanager
def half_weights_widened(widen: bool | None):
    """Builds and loads inside the block store half-precision weight matrices widened (True), as they
    are (False) or by the default rule (None)."""
    global _WIDEN
    before, _WIDEN = _WIDEN, widen
    try:
        yield
    finally:
        _WIDEN = before


def weight_matrix(value: Array, dtype, kind=nnx.Param) -> nnx.Variable:
    """A weight matrix of the requested ``dtype``: its values rounded to ``dtype``, stored widened to
    float32 when ``widen_half_weights()`` and ``dtype`` is half precision. A widened variable carries
    ``value_dtype`` (the requested dtype's name): loaders round checkpoint tensors to it first."""
    value = jnp.asarray(value).astype(dtype)
    if jnp.dtype(dtype).itemsize >= 4 or not jnp.issubdtype(dtype, jnp.floating) or not widen_half_weights():
        return kind(value)
    return kind(value.astype(jnp.float32), value_dtype=jnp.dtype(dtype).name)


def project(spec: str, x: Array, w: Array, accumulate_f32: bool = False) -> Array:
    """``einsum(spec, x, w)`` in the wider of x's and w's dtypes, returned in x's dtype (float32 when
    ``accumulate_f32``). Same dtypes: a plain matmul. Float32 x over bf16 w (exact mode): float32.
    Bf16 x over a widened float32 w (CPU): the float32 dot XLA's CPU backend runs for a bf16 one;
    ``reduce_precision`` keeps x rounded to bf16 as that dot's input is (XLA would otherwise drop the
    f32 -> bf16 -> f32 convert pair of an x computed in float32, as allowed excess precision)."""
    wide = jnp.promote_types(x.dtype, w.dtype)
    xw = x.astype(wide)
    if wide != x.dtype:
        f = jnp.finfo(x.dtype)
        xw = jax.lax.reduce_precision(xw, exponent_bits=f.nexp, mantissa_bits=f.nmant)
    y = jnp.einsum(spec, xw, w.astype(wide), preferred_element_type=jnp.float32 if accumulate_f32 else None)
    return y if accumulate_f32 else y.astype(x.dtype)


class InitKeys:
    """The parameter-init keys ``rngs.params()`` would draw (fold_in of the stream's key and a running
    count), counted in Python; ``commit`` advances ``rngs`` past them.

    nnx.Rngs counts in a Variable, and under ``nnx.eval_shape`` each draw updates it in the trace,
    where JAX's sharding lookup on the traced count walks the trace so far: abstract builds grew
    quadratic in the number of weights (Kimi-K2's 741 took 30 s). The values are the same either way.
    """

    def __init__(self, rngs: nnx.Rngs):
        self._rngs = rngs
        self._key = rngs.params.key[...]
        self._start = rngs.params.count[...]
        self._drawn = 0

    def params(self) -> Array:
        key = jax.random.fold_in(self._key, self._start + self._drawn)
        self._drawn += 1
        return key

    def commit(self) -> None:
        self._rngs.params.count[...] = self._start + self._drawn


# What module constructors draw init keys from (both have ``.params()``).
KeySource = nnx.Rngs | InitKeys


class Linear(nnx.Module):
    """y = x @ kernel (+ bias). The kernel is stored [in, out]: the transpose of a torch Linear weight,
    in ``weight_matrix``'s storage dtype."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool = False, dtype=jnp.float32, rngs: KeySource):
        std = 1.0 / math.sqrt(d_in)
        self.kernel = weight_matrix(jax.random.normal(rngs.params(), (d_in, d_out), jnp.float32) * std, dtype)
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

    def __call__(self, x: Array) -> Array:
        if self.bias is None:
            return project("...i,io->...o", x, self.kernel[...])
        # Bias added to the fp32 accumulator and rounded once, as torch's addmm does in half precision.
        y = project("...i,io->...o", x, self.kernel[...], accumulate_f32=True)
        return (y + self.bias[...].astype(jnp.float32)).astype(x.dtype)


# The gate activations by their HF names, each computed in float32 (as torch does for half inputs).
GATE_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU (silu) or GeGLU (gelu_pytorch_tanh, Gemma)."""

    def __init__(self, hidden: int, inter: int, *, act: str = "silu", dtype, rngs: KeySource):
        if act not in GATE_ACTIVATIONS:
            raise ValueError(f"unknown MLP activation '{act}'; known: {', '.join(GATE_ACTIVATIONS)}")
        self.act = act
        self.gate_proj = Linear(hidden, inter, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(hidden, inter, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(inter, hidden, dtype=dtype, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        # the activation in fp32, rounded once (torch computes it in fp32 for half inputs)
        act = GATE_ACTIVATIONS[self.act](self.gate_proj(x).astype(jnp.float32)).astype(x.dtype)
        return self.down_proj(act * self.up_proj(x))


# ----------------------------------------------------------------------------------------------- RoPE


def rope_inv_freq(rope: RopeConfig, dim: int, seq_len: Array | None = None) -> tuple[Array, float]:
    """Inverse frequencies (fp32, [dim/2]) and the cos/sin scale, as HF's rope init functions compute them.

    ``seq_len`` (max position + 1 of the current call) only matters for dynamic NTK scaling, whose base
    grows with the sequence once it passes the pretraining context.
    """
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    base = jnp.float32(rope.theta)
    scale = 1.0
    if rope.type == "dynamic":
        orig = rope.original_max_position_embeddings
        length = jnp.maximum(jnp.float32(orig) if seq_len is None else seq_len.astype(jnp.float32), orig)
        base = base * ((rope.factor * length / orig) - (rope.factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base**exponents)
    if rope.type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = jnp.where(medium, smoothed, scaled)
    elif rope.type == "yarn":
        inv_freq, scale = _yarn(rope, dim)
    return inv_freq, scale


def _yarn(rope: RopeConfig, dim: int) -> tuple[Array, float]:
    factor = rope.factor

    def mscale(s: float, m: float = 1.0) -> float:
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    if rope.attention_factor is not None:
        attn = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attn = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
    else:
        attn = mscale(factor)
    orig = rope.original_max_position_embeddings

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extra_factor = 1 - ramp
    pos_freqs = jnp.float32(rope.theta) ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extra_factor) + (1.0 / pos_freqs) * extra_factor
    return inv_freq, attn


def rope_cos_sin(rope: RopeConfig, dim: int, positions: Array, dtype) -> tuple[Array, Array]:
    """cos/sin [..., T, dim] for integer positions [..., T], built in fp32 and cast to ``dtype``."""
    seq_len = jnp.max(positions) + 1 if rope.type == "dynamic" else None
    inv_freq, scale = rope_inv_freq(rope, dim, seq_len)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return (jnp.cos(emb) * scale).astype(dtype), (jnp.sin(emb) * scale).astype(dtype)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate-half (NeoX) layout. x: [B, T, heads, D]; cos/sin: [B, T, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


# ------------------------------------------------------------------------------------------ attention


def attend(q: Array, k: Array, v: Array, mask: Array, score_dim: float | None = None) -> Array:
    """Grouped-query attention with an explicit boolean mask.

    q: [B, T, Hq, D]; k, v: head-major [B, Hkv, S, D], the cache's layout; mask: [B, T, S] (True = may
    attend). As the reference (EAGLE code, HF eager attention): scores q.k / sqrt(D) in the activation
    dtype, softmax in fp32, probabilities cast back to the activation dtype before the value product.
    ``score_dim``: the scores are over sqrt(score_dim) (default D; Gemma's ``query_pre_attn_scalar``).
    Returns [B, T, Hq * D].
    """
    b, t, hq, d = q.shape
    root = math.sqrt(score_dim or d)
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv
    # Head-major operands and the query group folded into the row axis: two plain batched matmuls
    # ([B*Hkv] x [g*T, D] x [D, S]), which XLA's CPU backend runs ~3x faster than the 5-d einsums.
    # Only the query block is transposed: the cache is stored head-major, so reading it copies nothing.
    qh = q.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
    if _few_queries(b, t):
        return _attend_few_queries(qh, k, v, mask, g, root).astype(q.dtype)
    kh, vh = k, v
    scores = (jnp.einsum("bkqd,bksd->bkqs", qh, kh) / root).astype(jnp.float32).reshape(b, hkv, g, t, s)
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, hkv, g * t, s)
    out = jnp.einsum("bkqs,bksd->bkqd", probs, vh).reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4)
    return out.reshape(b, t, hq * d)


# Query blocks up to this many positions (decoding, verification) over several rows take the few-query form on a CPU.
FEW_QUERIES_MAX = 16
# Up to this many cache slots the few-query form reads the whole span at once; past it, block by block.
WHOLE_SPAN_SLOTS = 1024


def _few_queries(b: int, t: int) -> bool:
    """Whether attention takes the few-query form: several rows of a few queries each on a CPU, where XLA packs the
    operands of a dot with so few query rows for nothing (BENCHMARKS.md, "Writing training data at batch 48").
    Accelerators choose their own layouts."""
    return b > 1 and t <= FEW_QUERIES_MAX and jax.default_backend() == "cpu"


def _few_query_scores(qh: Array, k: Array, root: float) -> Array:
    """q.k / root as a multiply-reduce over D: qh [B, Hkv, gT, D], k [B, Hkv, S, D] -> [B, Hkv, gT, S]."""
    return jnp.sum(k[:, :, None, :, :] * qh[:, :, :, None, :], axis=-1) / root


def _attend_few_queries(qh: Array, k: Array, v: Array, mask: Array, g: int, root: float) -> Array:
    """``attend`` in the few-query form over the whole span (the same numbers up to summation order): the scores
    a multiply-reduce, the softmax over the minor axis, float32 accumulation. qh: [B, Hkv, g*T, D]; returns
    [B, T, Hkv * g * D] float32."""
    b, hkv, gt, d = qh.shape
    s, t = k.shape[2], gt // g
    scores = _few_query_scores(qh, k.astype(qh.dtype), root).astype(jnp.float32).reshape(b, hkv, g, t, s)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, hkv, gt, s)
    out = jnp.einsum("bkqs,bksd->bkqd", probs, v.astype(qh.dtype), preferred_element_type=jnp.float32)
    return out.reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, hkv * g * d)


KV_BLOCK = 256  # cache slots attention over a cache reads per step of its loop (``softmax_over_blocks``)


def read_spans(slots: int) -> tuple[int, ...]:
    """The cache spans a round's cost is kept by (``decoding.chooser``): attention over a cache of ``slots``
    slots reads whole blocks of KV_BLOCK up to the last one a row reaches; these are powers of two from
    KV_BLOCK, then the whole cache (which replaces a power of two within 25% of it)."""
    out, s = [], KV_BLOCK
    while 1.25 * s < slots:
        out.append(s)
        s *= 2
    return (*out, slots)


def softmax_over_blocks(
    scores_of: Callable[[Array, Array], Array],
    values_of: Callable[[Array, Array], Array],
    mask: Array,
    value_dim: int,
) -> Array:
    """softmax(scores) @ values over the cache slots ``mask`` [B, T, S] lets some query reach, KV_BLOCK
    slots at a time, the softmax accumulated block by block (online, as flash attention does): a program
    costs what its rows use, not what its cache allocates, and on a CPU it runs ~2x faster than one
    softmax over the span (the scores stay in cache). A block no query of a row reaches adds exactly
    nothing to that row, so a row's output does not depend on the other rows' lengths.

    ``scores_of(start, block_mask)``: float32 scores [..., T, KV_BLOCK] of the slots start.. with
    ``block_mask`` [B, T, KV_BLOCK] applied (masked: float32 min); ``values_of(probs, start)``: probs
    [..., T, KV_BLOCK] times those slots' values, [..., T, value_dim] in float32. Returns
    [..., T, value_dim] float32; rows that reach nothing get zeros."""
    s = mask.shape[-1]
    block = min(KV_BLOCK, s)
    live = jnp.any(mask, axis=(0, 1))
    first = jnp.argmax(live) // block  # leading blocks out of every window are skipped too
    last = (s - jnp.argmax(live[::-1]) + block - 1) // block
    shape = jax.eval_shape(lambda: scores_of(jnp.int32(0), mask[..., :block])).shape
    lead = shape[:-1]

    def step(j, carry):
        m, total, acc = carry
        start = jnp.minimum(j * block, s - block)  # the last block overlaps the one before: its repeats masked
        fresh = (start + jnp.arange(block)) >= j * block
        scores = scores_of(start, jax.lax.dynamic_slice_in_dim(mask, start, block, axis=2) & fresh)
        m_new = jnp.maximum(m, scores.max(-1))
        scale, probs = jnp.exp(m - m_new), jnp.exp(scores - m_new[..., None])
        return m_new, total * scale + probs.sum(-1), acc * scale[..., None] + values_of(probs, start)

    init = (
        jnp.full(lead, -1e30, jnp.float32),
        jnp.zeros(lead, jnp.float32),
        jnp.zeros((*lead, value_dim), jnp.float32),
    )
    _, total, acc = jax.lax.fori_loop(first, jnp.where(jnp.any(live), last, first), step, init)
    return acc / jnp.where(total > 0, total, 1.0)[..., None]


def attend_cache(q: Array, k: Array, v: Array, mask: Array, score_dim: float | None = None) -> Array:
    """``attend`` over a head-major cache k, v [B, Hkv, S, D] under mask [B, T, S], block by block
    (``softmax_over_blocks``; on a CPU, rows of a few queries over at most WHOLE_SPAN_SLOTS slots read the span
    whole, which costs less there than the loop): the same scores (q.k / sqrt(D) in the activation dtype, the softmax in
    float32) and probabilities cast to the activation dtype before the value product, accumulated in
    float32; ``score_dim`` as for ``attend``. Returns [B, T, Hq * D] in q's dtype."""
    b, t, hq, d = q.shape
    root = math.sqrt(score_dim or d)
    hkv = k.shape[1]
    g = hq // hkv
    qh = q.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
    block = min(KV_BLOCK, k.shape[2])
    if _few_queries(b, t):
        if k.shape[2] <= WHOLE_SPAN_SLOTS:  # a short span costs less read whole than through the block loop
            return _attend_few_queries(qh, k, v, mask, g, root).astype(q.dtype)
        return _attend_cache_few_queries(qh, k, v, mask, g, root, block).astype(q.dtype)

    def scores_of(start, block_mask):
        kb = jax.lax.dynamic_slice_in_dim(k, start, block, axis=2).astype(q.dtype)
        scores = (jnp.einsum("bkqd,bksd->bkqs", qh, kb) / root).astype(jnp.float32).reshape(b, hkv, g, t, block)
        return jnp.where(block_mask[:, None, None], scores, jnp.finfo(jnp.float32).min)

    def values_of(probs, start):
        vb = jax.lax.dynamic_slice_in_dim(v, start, block, axis=2).astype(q.dtype)
        out = jnp.einsum(
            "bkqs,bksd->bkqd",
            probs.astype(q.dtype).reshape(b, hkv, g * t, block),
            vb,
            preferred_element_type=jnp.float32,
        )
        return out.reshape(b, hkv, g, t, d)

    out = softmax_over_blocks(scores_of, values_of, mask, d)  # [b, hkv, g, t, d]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq * d).astype(q.dtype)


def _attend_cache_few_queries(qh: Array, k: Array, v: Array, mask: Array, g: int, root: float, block: int) -> Array:
    """``_attend_few_queries`` block by block (``softmax_over_blocks``): for long spans that rows reach in part."""
    b, hkv, gt, d = qh.shape
    t = gt // g

    def scores_of(start, block_mask):
        kb = jax.lax.dynamic_slice_in_dim(k, start, block, axis=2).astype(qh.dtype)
        scores = _few_query_scores(qh, kb, root).astype(jnp.float32).reshape(b, hkv, g, t, block)
        return jnp.where(block_mask[:, None, None], scores, jnp.finfo(jnp.float32).min).reshape(b, hkv, gt, block)

    def values_of(probs, start):
        vb = jax.lax.dynamic_slice_in_dim(v, start, block, axis=2).astype(qh.dtype)
        return jnp.einsum("bkqs,bksd->bkqd", probs.astype(qh.dtype), vb, preferred_element_type=jnp.float32)

    out = softmax_over_blocks(scores_of, values_of, mask, d)  # [b, hkv, g*t, d]
    return out.reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, hkv * g * d)


def causal_mask(batch: int, length: int) -> Array:
    m = jnp.tril(jnp.ones((length, length), dtype=bool))
    return jnp.broadcast_to(m, (batch, length, length))


def window_mask(q_pos: Array, k_pos: Array, window: int | None) -> Array:
    """Causal mask by positions: q_pos [B, T], k_pos [B, S] -> [B, T, S], limited to a sliding window."""
    m = k_pos[:, None, :] <= q_pos[:, :, None]
    if window is not None:
        m &= (q_pos[:, :, None] - k_pos[:, None, :]) < window
    return m


def document_mask(positions: Array, segment_ids: Array, window: int | None = None) -> Array:
    """Causal within each document of packed rows: positions, segment_ids [B, T] -> [B, T, T].

    Positions restart at 0 in every document, so they order keys only inside one; the segment test
    keeps documents (and the padding, segment 0) apart. One document per row: ``window_mask``."""
    return window_mask(positions, positions, window) & (segment_ids[:, :, None] == segment_ids[:, None, :])


def attends_block(t: int, mask_width: int, cache_len: int | None) -> bool:
    """Whether a block of ``t`` queries under a mask ``mask_width`` wide attends over the block itself
    (no cache, or a [B, T, T] mask over a longer cache: a prefill from an empty cache) rather than over
    the cache's leading ``mask_width`` slots."""
    return cache_len is None or (mask_width == t and t < cache_len)


def heads_first(x: Array) -> Array:
    """[B, T, H, D] -> head-major [B, H, T, D], the cache layout."""
    return x.transpose(0, 2, 1, 3)


def write_kv(cache: Array, new: Array, start: Array) -> Array:
    """Writes new [b, T, Hkv, D] into the first b rows of the head-major cache [B, Hkv, S, D] at per-row
    slot ``start`` [b].

    b < B: a program over the leading rows of a larger cache (the serving engine's occupied slots),
    updated in place without copying the other rows.

    Several rows are a scatter, which XLA's CPU backend does for bfloat16 through a float32 copy of the whole
    cache and back: on a CPU a 16-bit float cache is scattered as its bits (uint16), exactly, with no such
    copy (BENCHMARKS.md, "Real size without weights (bench.scale)"). One row of one is an in-place
    ``dynamic_update_slice``, left as it is.
    """
    b, t, h = new.shape[:3]
    new = heads_first(new).astype(cache.dtype)
    scatter = b < cache.shape[0] or b > 1  # one row of one: an in-place dynamic_update_slice

    def write(c: Array, n: Array) -> Array:
        if b < c.shape[0]:
            rows = jnp.arange(b)[:, None, None]
            cols = (start[:, None] + jnp.arange(t)[None, :])[:, None, :]
            return c.at[rows, jnp.arange(h)[None, :, None], cols].set(n)
        return jax.vmap(lambda c_, n_, s: jax.lax.dynamic_update_slice(c_, n_, (0, s, 0)))(c, n, start)

    if (
        scatter
        and cache.dtype.itemsize == 2
        and jnp.issubdtype(cache.dtype, jnp.floating)
        and jax.default_backend() == "cpu"
    ):
        bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)  # noqa: E731
        return jax.lax.bitcast_convert_type(write(bits(cache), bits(new)), cache.dtype)
    return write(cache, new)


class Attention(nnx.Module):
    """Multi-head attention with GQA, optional q/k/v bias (Qwen2) and q/k RMSNorm (Qwen3; Gemma's with
    ``norm_unit_offset``), scores over sqrt(``score_dim``) (default head_dim; Gemma's query_pre_attn_scalar).

    ``d_in`` is the input width: H for a target layer, 2H for the drafter (embedding and feature).
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        bias: bool = False,
        qk_norm_eps: float | None = None,
        norm_unit_offset: bool = False,
        score_dim: float | None = None,
        dtype,
        rngs: KeySource,
    ):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.score_dim = score_dim
        self.scale = 1.0 / math.sqrt(score_dim or head_dim)
        self.q_proj = Linear(d_in, num_heads * head_dim, bias=bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d_in, num_kv_heads * head_dim, bias=bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d_in, num_kv_heads * head_dim, bias=bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(num_heads * head_dim, d_out, dtype=dtype, rngs=rngs)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, unit_offset=norm_unit_offset, dtype=dtype)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, unit_offset=norm_unit_offset, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None

    def heads(self, x: Array, cos: Array, sin: Array) -> tuple[Array, Array, Array]:
        """x [B, T, d_in] -> q [B, T, Hq, D], k / v [B, T, Hkv, D], q and k rotated."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    @staticmethod
    def _written(kv: tuple[Array, Array], k: Array, v: Array, write_index: Array) -> tuple[Array, Array]:
        return write_kv(kv[0], k, write_index), write_kv(kv[1], v, write_index)

    def _over_cache(self, q: Array, kv: tuple[Array, Array], mask: Array) -> Array:
        """q attending over the cache's leading ``mask.shape[-1]`` slots of its leading rows, reading only
        the blocks the mask reaches (``attend_cache``)."""
        b, span = q.shape[0], mask.shape[-1]
        return self.o_proj(attend_cache(q, kv[0][:b, :, :span], kv[1][:b, :, :span], mask, self.score_dim))

    def write(
        self, x: Array, cos: Array, sin: Array, kv: tuple[Array, Array], write_index: Array
    ) -> tuple[Array, Array]:
        """Writes the block's keys/values into ``kv`` at slots ``write_index`` [B] without attending
        (what ``__call__`` writes first)."""
        _, k, v = self.heads(x, cos, sin)
        return self._written(kv, k, v, write_index)

    def read(self, x: Array, cos: Array, sin: Array, mask: Array, kv: tuple[Array, Array]) -> Array:
        """x: [B, T, d_in] attending over the cache's leading ``mask.shape[-1]`` slots under ``mask``
        [B, T, S'], which already hold what it needs (its own keys/values included): nothing written."""
        q, _, _ = self.heads(x, cos, sin)
        return self._over_cache(q, kv, mask)

    def __call__(
        self,
        x: Array,
        cos: Array,
        sin: Array,
        mask: Array,
        kv: tuple[Array, Array] | None = None,
        write_index: Array | None = None,
    ) -> tuple[Array, tuple[Array, Array] | None]:
        """x: [B, T, d_in]. Without a cache, attends over the block itself; with ``kv`` = (k, v) caches
        [B, Hkv, S, D] (head-major), writes this block's keys/values at slots ``write_index`` [B] first, then attends
        over the first S' cache slots under ``mask`` [B, T, S'] (S' <= S; the cache may have more rows than x,
        whose leading rows are then used) — or, when ``mask`` is [B, T, T] with T < S (a prefill from
        an empty cache), over the block itself, which costs T x T instead of T x S."""
        t = x.shape[1]
        q, k, v = self.heads(x, cos, sin)
        if kv is None:
            return self.o_proj(attend(q, heads_first(k), heads_first(v), mask, self.score_dim)), None
        kv = self._written(kv, k, v, write_index)
        if attends_block(t, mask.shape[-1], kv[0].shape[2]):
            return self.o_proj(attend(q, heads_first(k), heads_first(v), mask, self.score_dim)), kv
        return self._over_cache(q, kv, mask), kv
