"""The speculative decoding program: prefill, then a ``lax.while_loop`` of draft -> verify -> accept rounds.

Everything here is a pure function of the (target, drafter) modules and arrays, traced once per static
configuration. Caches are addressed by per-row lengths: rejected drafts are rolled back by not moving
the length, never by copying; tree verification writes all nodes past the end and gathers the accepted
path into contiguous slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from eagle_jax.config import SpecConfig
from eagle_jax.decoding.sampling import SamplingParams, accept_chain, draft_probs, sample, target_probs
from eagle_jax.decoding.state import LoopState, emit
from eagle_jax.decoding.tree import TreeShape, accept as accept_tree, grow, verify_mask
from eagle_jax.modeling.drafter import Drafter
from eagle_jax.modeling.target import KVCache, Target, window_mask

Array = jax.Array


@dataclass(frozen=True)
class Plan:
    """Static shape of one compiled program."""

    batch: int
    prompt_len: int  # bucketed (padded) prompt length
    max_new: int
    spec: SpecConfig | None  # None: plain decoding
    sampling: SamplingParams
    eos_ids: tuple[int, ...]
    mesh: Any = None  # tensor parallel: caches are laid out by the sharding rules

    @property
    def width(self) -> int:
        """Tokens emitted per round at most."""
        return 1 if self.spec is None else self.spec.max_emitted

    @property
    def cache_len(self) -> int:
        """Slots per row: prompt + generated + the scratch a round writes past the committed length."""
        scratch = 1 if self.spec is None else max(self.spec.verify_width, self.spec.max_emitted)
        if self.spec is not None and self.spec.method == "tree":
            scratch = max(scratch, (self.spec.tree_depth - 1) * self.spec.tree_top_k)
        return self.prompt_len + self.max_new + scratch + 1

    @property
    def max_rounds(self) -> int:
        return self.max_new


def causal_cache_mask(q_pos: Array, cache_len: int, window: int | None) -> Array:
    """[B, T, S] for a block at positions q_pos [B, T] over cache slots holding positions 0..S-1."""
    slots = jnp.broadcast_to(jnp.arange(cache_len), (q_pos.shape[0], cache_len))
    return window_mask(q_pos, slots, window)


def _pick(logits: Array, sp: SamplingParams, key: Array) -> Array:
    """The target's next token from logits [B, V]: argmax, or a sample from p."""
    if sp.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return sample(key, target_probs(logits, sp))


def _placed(plan: Plan, cache):
    """Lays a fresh KV cache out as the rule table says (kv heads over "model") under a mesh."""
    if plan.mesh is None:
        return cache
    from jax.sharding import NamedSharding

    from eagle_jax.sharding import kv_cache_spec

    def place(x):
        return jax.lax.with_sharding_constraint(x, NamedSharding(plan.mesh, kv_cache_spec(plan.mesh, x.shape)))

    return jax.tree.map(place, cache)


def prefill(target: Target, drafter: Drafter | None, plan: Plan, prompt: Array, lens: Array, key: Array) -> LoopState:
    """Runs the padded prompts through the target (capturing aux states) and the drafter."""
    b, p = prompt.shape
    s = plan.cache_len
    window = target.config.sliding_window
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    zero = jnp.zeros((b,), jnp.int32)
    # The prompt block attends only to itself (P x P), then sits in cache slots 0..P-1.
    block_mask = window_mask(positions, positions, window)
    hidden, aux, t_cache = target.forward(prompt, positions, block_mask, _placed(plan, target.init_cache(b, s)), zero)
    last = lens - 1
    key, k_first = jax.random.split(key)
    first = _pick(target.logits(jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]), plan.sampling, k_first)
    d_cache = d_logits = d_feat = None
    if drafter is not None:
        # Pair (feature of position t, token t+1): the prompt shifted left, the first generated token last.
        nxt = jnp.concatenate([prompt[:, 1:], zero[:, None]], axis=1)
        nxt = jnp.where(jnp.arange(p)[None, :] == last[:, None], first[:, None], nxt)
        normed, feat, d_cache = drafter.layer(
            drafter.fuse(aux.astype(drafter.dtype)), nxt, positions, window_mask(positions, positions, None), _placed(plan, drafter.init_cache(b, s)), zero
        )
        normed_last = jnp.take_along_axis(normed, last[:, None, None], axis=1)[:, 0]
        d_logits = drafter.lm_head(normed_last)
        d_feat = jnp.take_along_axis(feat, last[:, None, None], axis=1)[:, 0]
    w = plan.width
    state = LoopState(
        t_cache=t_cache,
        d_cache=d_cache,
        length=lens.astype(jnp.int32),
        pending=first,
        d_logits=d_logits,
        d_feat=d_feat,
        out=jnp.zeros((b, plan.max_new + w), jnp.int32),
        n_out=zero,
        done=jnp.zeros((b,), bool),
        accepted=jnp.full((b, plan.max_rounds), -1, jnp.int32),
        rounds=jnp.int32(0),
        key=key,
    )
    out, n_out, done = emit(state, first[:, None], jnp.ones((b,), jnp.int32), plan.eos_ids, plan.max_new)
    state.out, state.n_out, state.done = out, n_out, done
    return state


def _draft_chain(drafter: Drafter, plan: Plan, st: LoopState, key: Array):
    """K drafts: the carried drafter output gives the first, K-1 single steps on the drafter's own features.

    Returns (draft target ids [B,K], draft ids [B,K], q [B,K,Vd] or None, drafter cache).
    """
    k = plan.spec.num_speculative_tokens
    sp = plan.sampling
    s = plan.cache_len
    logits, feat, cache = st.d_logits, st.d_feat, st.d_cache
    ids, qs = [], []
    keys = jax.random.split(key, k)
    for i in range(k):
        if sp.greedy:
            d = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # argmax in the draft vocabulary
        else:
            q = draft_probs(logits, sp)
            d = sample(keys[i], q)
            qs.append(q)
        ids.append(d)
        if i == k - 1:
            break
        pos = (st.length + i)[:, None]
        normed, feat3, cache = drafter.layer(
            feat[:, None], drafter.draft_to_target(d)[:, None], pos, causal_cache_mask(pos, s, None), cache, st.length + i
        )
        logits, feat = drafter.lm_head(normed[:, 0]), feat3[:, 0]
    draft_ids = jnp.stack(ids, axis=1)
    return drafter.draft_to_target(draft_ids), draft_ids, (jnp.stack(qs, axis=1) if qs else None), cache


def _extend_drafter(drafter: Drafter, plan: Plan, aux: Array, next_tokens: Array, n: Array, length: Array, cache):
    """Feeds the accepted pairs (target feature, next token) at positions length.. into the drafter cache.

    Returns the drafter's logits and feature at the last accepted pair (index n).
    """
    b, w = next_tokens.shape
    pos = length[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
    normed, feat, cache = drafter.layer(
        drafter.fuse(aux.astype(drafter.dtype)), next_tokens, pos, causal_cache_mask(pos, plan.cache_len, None), cache, length
    )
    normed_n = jnp.take_along_axis(normed, n[:, None, None], axis=1)[:, 0]
    return drafter.lm_head(normed_n), jnp.take_along_axis(feat, n[:, None, None], axis=1)[:, 0], cache


def _round_plain(target: Target, plan: Plan, st: LoopState, key: Array):
    pos = st.length[:, None]
    hidden, _, t_cache = target.forward(
        st.pending[:, None], pos, causal_cache_mask(pos, plan.cache_len, target.config.sliding_window), st.t_cache, st.length
    )
    nxt = _pick(target.logits(hidden[:, 0]), plan.sampling, key)
    zero = jnp.zeros_like(st.length)
    return t_cache, None, zero, nxt[:, None], None, None


def _round_chain(target: Target, drafter: Drafter, plan: Plan, st: LoopState, key: Array):
    k = plan.spec.num_speculative_tokens
    k_draft, k_acc = jax.random.split(key)
    drafts, draft_ids, q, d_cache = _draft_chain(drafter, plan, st, k_draft)
    block = jnp.concatenate([st.pending[:, None], drafts], axis=1)
    pos = st.length[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    hidden, aux, t_cache = target.forward(
        block, pos, causal_cache_mask(pos, plan.cache_len, target.config.sliding_window), st.t_cache, st.length
    )
    logits = target.logits(hidden)
    if plan.sampling.greedy:
        pred = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        n = jnp.sum(jnp.cumprod(drafts == pred[:, :k], axis=1), axis=1).astype(jnp.int32)
        bonus = jnp.take_along_axis(pred, n[:, None], axis=1)[:, 0]
    else:
        t2d_index = drafter.draft_to_target(jnp.arange(drafter.config.draft_vocab_size))
        n, bonus = accept_chain(k_acc, target_probs(logits, plan.sampling), q, drafts, draft_ids, t2d_index)
    emitted = jnp.where(jnp.arange(k + 1)[None, :] == n[:, None], bonus[:, None], jnp.concatenate([drafts, drafts[:, :1]], axis=1))
    d_logits, d_feat, d_cache = _extend_drafter(drafter, plan, aux, emitted, n, st.length, d_cache)
    return t_cache, d_cache, n, emitted, d_logits, d_feat


def _gather_path(cache: KVCache, path: Array, length: Array) -> KVCache:
    """Moves the accepted tree path's KV (slots length + path[j]) to contiguous slots length + j."""
    src = length[:, None] + path  # path[j] >= j: a source is never overwritten before it is read

    def move(c):
        rows = jnp.take_along_axis(c, src[:, :, None, None], axis=1)
        return jax.vmap(lambda ci, r, s0: jax.lax.dynamic_update_slice(ci, r, (s0, 0, 0)))(c, rows, length)

    return KVCache(tuple(move(k) for k in cache.k), tuple(move(v) for v in cache.v))


def _round_tree(target: Target, drafter: Drafter, plan: Plan, st: LoopState, key: Array):
    sp_ = plan.spec
    shape = TreeShape(sp_.tree_top_k, sp_.tree_depth, sp_.tree_total_tokens)
    tree, d_cache = grow(drafter, shape, st.d_logits, st.d_feat, st.d_cache, st.length)
    tree.tokens = tree.tokens.at[:, 0].set(st.pending)
    pos = st.length[:, None] + tree.depth
    mask = verify_mask(tree, st.length, plan.cache_len)
    if target.config.sliding_window is not None:
        mask &= causal_cache_mask(pos, plan.cache_len, target.config.sliding_window) | (jnp.arange(plan.cache_len) >= st.length[:, None])[:, None, :]
    hidden, aux, t_cache = target.forward(tree.tokens, pos, mask, st.t_cache, st.length)
    path, n, bonus = accept_tree(key, tree, target.logits(hidden), plan.sampling, shape)
    t_cache = _gather_path(t_cache, path, st.length)
    path_tokens = jnp.take_along_axis(tree.tokens, path, axis=1)
    w = shape.depth + 1
    emitted = jnp.where(jnp.arange(w)[None, :] == n[:, None], bonus[:, None], jnp.concatenate([path_tokens[:, 1:], path_tokens[:, :1]], axis=1))
    path_aux = jnp.take_along_axis(aux, path[:, :, None], axis=1)
    d_logits, d_feat, d_cache = _extend_drafter(drafter, plan, path_aux, emitted, n, st.length, d_cache)
    return t_cache, d_cache, n, emitted, d_logits, d_feat


def one_round(target: Target, drafter: Drafter | None, plan: Plan, st: LoopState) -> LoopState:
    """draft -> verify -> accept -> cache update for every row; finished rows keep their state."""
    key, k_round = jax.random.split(st.key)
    if plan.spec is None:
        t_cache, d_cache, n, emitted, d_logits, d_feat = _round_plain(target, plan, st, k_round)
    elif plan.spec.method == "chain":
        t_cache, d_cache, n, emitted, d_logits, d_feat = _round_chain(target, drafter, plan, st, k_round)
    else:
        t_cache, d_cache, n, emitted, d_logits, d_feat = _round_tree(target, drafter, plan, st, k_round)
    active = ~st.done
    bonus = jnp.take_along_axis(emitted, n[:, None], axis=1)[:, 0]
    out, n_out, done = emit(st, emitted, n + 1, plan.eos_ids, plan.max_new)

    def keep(new, old):
        if new is None:
            return None
        return jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)

    return LoopState(
        t_cache=t_cache,  # finished rows wrote only past their frozen length
        d_cache=d_cache,
        length=jnp.where(active, st.length + n + 1, st.length),
        pending=keep(bonus, st.pending),
        d_logits=keep(d_logits, st.d_logits),
        d_feat=keep(d_feat, st.d_feat),
        out=out,
        n_out=n_out,
        done=done,
        # Drafts that became output: a round cut short by EOS or max_new counts what it emitted.
        accepted=st.accepted.at[:, st.rounds].set(jnp.where(active, n_out - st.n_out - 1, -1)),
        rounds=st.rounds + 1,
        key=key,
    )


def run_rounds(target: Target, drafter: Drafter | None, plan: Plan, st: LoopState, limit: Array) -> LoopState:
    """Rounds until every row is done or ``limit`` rounds have run in total."""

    def cond(s: LoopState):
        return jnp.any(~s.done) & (s.rounds < jnp.minimum(limit, plan.max_rounds))

    return jax.lax.while_loop(cond, lambda s: one_round(target, drafter, plan, s), st)
