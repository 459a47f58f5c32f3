"""Speculation chosen by measured cost: ``spec="auto"``, the default of ``generate`` with a drafter.

A round of K chain drafts costs K drafter steps plus one target forward of K+1 positions (and the
drafter's extension over them), and emits 1 + (accepted drafts) tokens; plain decoding costs one
target step per token. How those costs relate depends on the machine and the batch: with few rows a
step reads weights and K+1 positions cost about as much as one (speculation pays); with many rows it
is compute-bound and each verified position costs nearly a full step (it does not). So ``calibrate``
times the parts once per (model pair, batch, cache length, dtype) on this machine, and

- ``choose`` returns an adaptive chain (``SpecConfig(adaptive=True)``): each round drafts while the
  drafter's cumulative confidence, in tokens, is worth a drafter step, and verifies the static width
  with the most expected tokens per second (engine ``_round_adaptive``), so a low-acceptance stretch
  costs a width-1 round; or
- no speculation at all, when even drafts that are always accepted could not beat plain decoding:
  ``max_w w x plain_s / (verify_s(w) + (w-1) x draft_s) < 1 + MARGIN`` (as vLLM's
  ``disable_by_batch_size`` does by hand).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.config import SpecConfig
from eagle_jax.decoding.engine import Plan, RoundCosts, _extend_drafter, _forward, causal_cache_mask, target_dtype
from eagle_jax.modeling.drafter import Drafter
from eagle_jax.modeling.target import Target

MAX_DRAFTS = 6  # an adaptive round's deepest chain
WIDTHS = (1, 2, 4)  # its verification widths (1 + drafts): a compiled branch each
MARGIN = 0.05  # speculation must promise at least this much to be chosen at all
_REPEATS = 7

_COSTS: dict[Any, RoundCosts] = {}


def widths_for(k: int) -> tuple[int, ...]:
    """Verification widths of an adaptive chain of at most ``k`` drafts: WIDTHS up to k + 1, and k + 1."""
    return tuple(sorted({w for w in WIDTHS if w <= k} | {k + 1}))


def _median_s(fn, *args) -> float:
    jax.block_until_ready(fn(*args))  # compiled and warm
    times = []
    for _ in range(_REPEATS):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def calibrate(target: Target, drafter: Drafter, plan: Plan, widths: tuple[int, ...]) -> RoundCosts:
    """Times the parts of a round at ``plan``'s batch, cache length and dtype (cached per shapes).

    Each part runs as its own small jitted program over caches of the plan's size (attention reads
    the whole allocated cache, as the loop does): a plain target step, a target forward of each
    width followed by the drafter's extension over it, and one drafter step."""
    t_graph, t_state = nnx.split(target)
    d_graph, d_state = nnx.split(drafter)
    key = (t_graph, d_graph, plan.batch, plan.cache_len, plan.exact, widths, str(target.dtype), str(drafter.dtype))
    if key in _COSTS:
        return _COSTS[key]
    b, s = plan.batch, plan.cache_len
    length = jnp.full((b,), s // 2, jnp.int32)  # a half-full cache: positions and masks as mid-run
    t_cache = target.init_cache(b, s, target_dtype(target, plan))
    d_cache = drafter.init_cache(b, s)
    probe = Plan(b, s, 1, None, plan.greedy, (), None, plan.mesh, plan.exact)

    def target_step(t_state, t_cache, w, with_drafter):
        tgt = nnx.merge(t_graph, t_state)
        pos = length[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
        mask = causal_cache_mask(pos, s, tgt.config.sliding_window)
        hidden, aux, t_cache = _forward(tgt, nnx.merge(d_graph, d_state) if with_drafter else None, probe,
                                        jnp.zeros((b, w), jnp.int32), pos, mask, t_cache, length)
        return tgt.logits(hidden), aux, t_cache

    @jax.jit
    def plain(t_state, t_cache):
        return target_step(t_state, t_cache, 1, False)[::2]

    def round_of(w):
        @jax.jit
        def run(t_state, d_state, t_cache, d_cache):
            logits, aux, t_cache = target_step(t_state, t_cache, w, True)
            drf = nnx.merge(d_graph, d_state)
            tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return t_cache, _extend_drafter(drf, probe, aux, tokens, jnp.zeros((b,), jnp.int32), length, d_cache)

        return run

    @jax.jit
    def draft_step(d_state, d_cache, feat):
        drf = nnx.merge(d_graph, d_state)
        pos = length[:, None]
        normed, feat3, d_cache = drf.layer(feat[:, None], jnp.zeros((b, 1), jnp.int32), pos, causal_cache_mask(pos, s, None), d_cache, length)
        return drf.lm_head(normed[:, 0]), feat3[:, 0], d_cache

    feat = jnp.zeros((b, drafter.config.hidden_size), drafter.dtype)
    costs = RoundCosts(
        widths=widths,
        verify_s=tuple(_median_s(round_of(w), t_state, d_state, t_cache, d_cache) for w in widths),
        draft_s=_median_s(draft_step, d_state, d_cache, feat),
        plain_s=_median_s(plain, t_state, t_cache),
    )
    _COSTS[key] = costs
    return costs


def best_case_speedup(costs: RoundCosts) -> float:
    """Speedup over plain decoding if every draft were accepted, at the best width."""
    return max(w * costs.plain_s / (v + (w - 1) * costs.draft_s) for w, v in zip(costs.widths, costs.verify_s))


def choose(target: Target, drafter: Drafter, plan: Plan, max_drafts: int = MAX_DRAFTS) -> tuple[SpecConfig | None, RoundCosts]:
    """(an adaptive chain of at most ``max_drafts`` drafts, or None: decode without the drafter; the costs)."""
    costs = calibrate(target, drafter, plan, widths_for(max_drafts))
    if best_case_speedup(costs) < 1 + MARGIN:
        return None, costs
    return SpecConfig(num_speculative_tokens=max_drafts, adaptive=True), costs
