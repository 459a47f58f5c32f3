"""Prompts into caches: the whole prompt at once (``prefill``, ``start``: ``generate``'s first step), or a
chunk at a time after what a cache already holds (``prefill_chunk``: the serving engine's prefill, in
chunks, and its prefix reuse).

A drafter's cache entry at position t pairs the target's aux states at t with token t+1, so a prompt's
entries need only the prompt, except the last one, which pairs with the first generated token. An
entry's keys and values need only its own pair; the drafter's outputs (attention, MLP, lm_head) are
needed only at a prompt's last position, where drafting starts, so only there are they computed
(``_drafter_prompt``).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from eagle_jax.decoding.engine import Plan, causal_cache_mask, pick, placed, target_dtype, target_forward
from eagle_jax.decoding.sampling import RowSampling, split_rows
from eagle_jax.decoding.state import LoopState, counted, emit
from eagle_jax.modeling.drafter import Drafter
from eagle_jax.modeling.target import KVCache, Target, window_mask

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclass
class Prefilled:
    """What a prompt leaves behind: caches holding it, the first token and the drafter's next outputs."""

    t_cache: KVCache
    d_cache: tuple[Array, Array] | None
    first: Array  # [B]
    d_logits: Array | None
    d_feat: Array | None


def _drafter_prompt(
    drafter: Drafter, aux: Array, nxt: Array, positions: Array, cache, write_index: Array, at: Array, mask_at: Array
):
    """The drafter over a block of prompt pairs (aux states [B, T, A] of position t, token t+1 ``nxt``
    [B, T]): every pair's keys and values written into ``cache`` from slot ``write_index`` [B]; the
    layer's outputs only at block indices ``at`` [B, M], attending over the cache under ``mask_at``
    [B, M, S]. The attention and MLP of the other positions, most of a drafter's prefill, would never be
    read. Returns (logits [B, M, Vd], features [B, M, H], cache)."""
    g = drafter.fuse(aux.astype(drafter.dtype))
    cache = drafter.write_cache(g, nxt, positions, cache, write_index)

    def take(x):
        return jnp.take_along_axis(x, at[:, :, None] if x.ndim == 3 else at, axis=1)

    normed, feat = drafter.read_cache(take(g), take(nxt), take(positions), mask_at, cache)
    return drafter.lm_head(normed), feat, cache


def prefill(
    target: Target, drafter: Drafter | None, plan: Plan, prompt: Array, lens: Array, rs: RowSampling, keys: Array
) -> Prefilled:
    """Runs the padded prompts [B, P] through the target (capturing aux states) and the drafter, into
    fresh caches of ``plan.cache_len`` slots; picks each row's first token with its key."""
    b, p = prompt.shape
    s = plan.cache_len
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    zero = jnp.zeros((b,), jnp.int32)
    # The prompt block attends only to itself (P x P), then sits in cache slots 0..P-1.
    block_mask = window_mask(positions, positions, None)  # sliding layers narrow it themselves (Target.forward)
    t_cache = placed(plan, target.init_cache(b, s, target_dtype(target, plan)))
    hidden, aux, t_cache = target_forward(target, drafter, plan, prompt, positions, block_mask, t_cache, zero)
    last = lens - 1
    last_logits = target.logits(jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0])
    first = pick(last_logits, plan, rs, keys)
    if drafter is None:
        return Prefilled(t_cache, None, first, None, None)
    # Pair (feature of position t, token t+1): the prompt shifted left, the first generated token last.
    nxt = jnp.concatenate([prompt[:, 1:], zero[:, None]], axis=1)
    nxt = jnp.where(jnp.arange(p)[None, :] == last[:, None], first[:, None], nxt)
    d_logits, d_feat, d_cache = _drafter_prompt(
        drafter,
        aux,
        nxt,
        positions,
        placed(plan, drafter.init_cache(b, s)),
        zero,
        last[:, None],
        causal_cache_mask(last[:, None], s, None),
    )
    return Prefilled(t_cache, d_cache, first, d_logits[:, 0], d_feat[:, 0])


def start(
    target: Target,
    drafter: Drafter | None,
    plan: Plan,
    prompt: Array,
    lens: Array,
    rs: RowSampling,
    key: Array,
    max_new: int,
) -> LoopState:
    """Prefill, then the loop state of ``generate``: the first token emitted, ``max_new`` tokens per row."""
    b = prompt.shape[0]
    keys = jax.random.split(key, b)  # one stream per row: a row's draws do not depend on the others
    sub = split_rows(keys, 2)
    pre = prefill(target, drafter, plan, prompt, lens, rs, sub[:, 1])
    zero = jnp.zeros((b,), jnp.int32)
    state = LoopState(
        t_cache=pre.t_cache,
        d_cache=pre.d_cache,
        length=lens.astype(jnp.int32),
        pending=pre.first,
        d_logits=pre.d_logits,
        d_feat=pre.d_feat,
        out=jnp.zeros((b, max_new + plan.width), jnp.int32),
        n_out=zero,
        limit=jnp.full((b,), max_new, jnp.int32),
        done=jnp.zeros((b,), bool),
        accepted=jnp.full((b, plan.max_rounds), -1, jnp.int32),
        rounds=jnp.int32(0),
        sampling=rs,
        key=sub[:, 0],
        probe=None if drafter is None else jnp.zeros((b, 2), jnp.float32),
    )
    state.out, state.n_out, state.done = emit(state, pre.first[:, None], jnp.ones((b,), jnp.int32), plan.eos_ids)
    state.sampling = counted(rs, pre.first[:, None], state.n_out)
    return state


def prefill_chunk(
    target: Target,
    drafter: Drafter | None,
    plan: Plan,
    ids: Array,
    start: Array,
    plen: Array,
    t_cache: KVCache,
    d_cache,
    rs: RowSampling,
    keys: Array,
) -> Prefilled:
    """One chunk of a prompt after the ``start`` [B] positions the caches already hold: target positions
    ``start..start+C-1`` of ``ids`` [B, C+1] (the prompt's tokens from ``start``, padded; the last column
    only feeds the drafter its next token), attending over the cache's leading ``plan.cache_len`` slots.
    The drafter's entries ``start..start+C-1`` are written too, each with the next prompt token, and the
    one at the prompt's last position with the first generated token.

    Where the chunk reaches the prompt's end (``start + C >= plen``), the result's ``first``, drafter
    outputs, last logits and aux states are the prompt's, as ``prefill`` gives them; elsewhere they are
    those of the chunk's last position and mean nothing. Padding past the prompt writes cache slots that
    are rewritten before they are read."""
    c = ids.shape[1] - 1
    pos = start[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]
    mask = causal_cache_mask(pos, plan.cache_len, None)
    hidden, aux, t_cache = target_forward(target, drafter, plan, ids[:, :c], pos, mask, t_cache, start)
    at = jnp.clip(plen - 1 - start, 0, c - 1)  # the prompt's last position within the chunk
    last_logits = target.logits(jnp.take_along_axis(hidden, at[:, None, None], axis=1)[:, 0])
    first = pick(last_logits, plan, rs, keys)
    if drafter is None:
        return Prefilled(t_cache, None, first, None, None)
    ends = (jnp.arange(c)[None, :] == at[:, None]) & (start + c >= plen)[:, None]  # the prompt's last position is here
    nxt = jnp.where(ends, first[:, None], ids[:, 1:])
    d_logits, d_feat, d_cache = _drafter_prompt(
        drafter,
        aux,
        nxt,
        pos,
        d_cache,
        start,
        at[:, None],
        causal_cache_mask((start + at)[:, None], plan.cache_len, None),
    )
    return Prefilled(t_cache, d_cache, first, d_logits[:, 0], d_feat[:, 0])
