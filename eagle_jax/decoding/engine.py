"""The speculative decoding program: a ``lax.while_loop`` of draft -> verify -> accept rounds (after the
prompt's prefill, ``decoding.prefill``).

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

from eagle_jax.config import SpecConfig, aux_layer_ids_for
from eagle_jax.decoding import penalties
from eagle_jax.decoding.sampling import RowSampling, accept_chain, draft_probs, sample, split_rows, target_probs
from eagle_jax.decoding.state import LoopState, counted, emit
from eagle_jax.decoding.tree import TreeShape, grow, verify_mask
from eagle_jax.decoding.tree import accept as accept_tree
from eagle_jax.modeling.drafter import Drafter
from eagle_jax.modeling.layers import write_kv
from eagle_jax.modeling.target import KVCache, Target, window_mask

Array = jax.Array


def scratch_slots(spec: SpecConfig | None) -> int:
    """Cache slots a round writes past a row's committed length."""
    if spec is None:
        return 1
    scratch = max(spec.verify_width, spec.max_emitted)
    if spec.method == "tree":
        scratch = max(scratch, (spec.tree_depth - 1) * spec.tree_top_k)
    return scratch


def one_shot_cache_len(prompt_len: int, max_new: int, spec: SpecConfig | None) -> int:
    return prompt_len + max_new + scratch_slots(spec) + 1


@dataclass(frozen=True)
class Plan:
    """Static shape of one compiled program.

    ``spec`` None with a drafter: rounds verify no drafts (one target token each) but still feed the
    drafter, so a later program with drafts can take over the same state (the serving engine switches
    speculation depth with the number of active slots).
    """

    batch: int
    cache_len: int  # allocated cache slots per row
    max_rounds: int  # rounds one run of the program may take
    spec: SpecConfig | None
    greedy: bool  # every row greedy: the program has no sampling code at all
    eos_ids: tuple[int, ...]
    mesh: Any = None  # tensor parallel: caches are laid out by the sharding rules
    exact: bool = False  # the target computes in float32 whatever its weights' dtype (see ``target_dtype``)
    # Rounds without drafts (``spec`` None with a drafter) only write the drafter's cache, and compute its
    # outputs (``extend_drafter``) only in a run's last round (``run_rounds``' limit), which leaves them current
    # for the next program; the first draft's acceptance is probed in the first round only. The serving
    # engine's steps: there a run is one step. Feeding the drafter in full every round would add a few percent
    # to a plain step (the probe's target probabilities at T > 0 the most).
    lazy_feed: bool = False

    @classmethod
    def one_shot(
        cls,
        batch: int,
        prompt_len: int,
        max_new: int,
        spec: SpecConfig | None,
        greedy: bool,
        eos_ids: tuple[int, ...],
        mesh: Any = None,
        exact: bool = False,
    ) -> "Plan":
        """The plan of ``generate``: prompts padded to ``prompt_len``, ``max_new`` tokens per row."""
        return cls(batch, one_shot_cache_len(prompt_len, max_new, spec), max_new, spec, greedy, eos_ids, mesh, exact)

    @property
    def width(self) -> int:
        """Tokens emitted per round at most."""
        return 1 if self.spec is None else self.spec.max_emitted


def target_dtype(target: Target, plan: Plan):
    """The target's activation and cache dtype in this program.

    Exact mode computes in float32 from the stored (e.g. bf16) weights: in bf16 a position's logits
    depend, by rounding, on how many positions and rows a matmul covers, so verifying K+1 positions
    at once, or a row in a larger batch, can flip a near-tie that plain batch-1 decoding resolves the
    other way. In float32 such flips need logit gaps near 1e-6, and the output is plain decoding's."""
    return jnp.float32 if plan.exact else target.dtype


def target_forward(target: Target, drafter: Drafter | None, plan: Plan, tokens, positions, mask, cache, write_index):
    """A target forward in the plan's dtype, capturing the layers the drafter reads (none without one)."""
    aux_ids = () if drafter is None else aux_layer_ids_for(drafter.config, target.config)
    return target.forward(tokens, positions, mask, cache, write_index, aux_ids, target_dtype(target, plan))


def causal_cache_mask(q_pos: Array, cache_len: int, window: int | None, live: Array | None = None) -> Array:
    """[B, T, S] for a block at positions q_pos [B, T] over cache slots holding positions 0..S-1. Rows not
    ``live`` [B] (done: their outputs are never kept) attend to nothing, so that attention's span
    (``layers.softmax_over_blocks``) follows the live rows only."""
    slots = jnp.broadcast_to(jnp.arange(cache_len), (q_pos.shape[0], cache_len))
    mask = window_mask(q_pos, slots, window)
    return mask if live is None else mask & live[:, None, None]


def processed(logits: Array, rs: RowSampling, block: Array | None = None, paths: Array | None = None) -> Array:
    """The target's logits under the rows' penalties (``penalties.apply``); unchanged without them."""
    return logits if rs.penalties is None else penalties.apply(logits, rs.penalties, block, paths)


def pick(logits: Array, plan: Plan, rs: RowSampling, keys: Array | None) -> Array:
    """The target's next token from logits [B, V] (penalties applied here): argmax, or a sample from each row's p."""
    logits = processed(logits, rs)
    if plan.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return sample(keys, target_probs(logits, rs))


def placed(plan: Plan, cache):
    """Lays a fresh KV cache out as the rule table says (kv heads over "model") under a mesh."""
    if plan.mesh is None:
        return cache
    from jax.sharding import NamedSharding

    from eagle_jax.sharding import kv_cache_spec

    def place(x):
        return jax.lax.with_sharding_constraint(x, NamedSharding(plan.mesh, kv_cache_spec(plan.mesh, x.shape)))

    return jax.tree.map(place, cache)


def _draft_chain(drafter: Drafter, plan: Plan, st: LoopState, keys: Array | None, k: int):
    """K drafts: the carried drafter output gives the first, K-1 single steps on the drafter's own features.

    Returns (draft target ids [B,K], draft ids [B,K], q [B,K,Vd] or None when greedy, drafter cache).
    """
    b = st.length.shape[0]
    logits, feat, cache = st.d_logits, st.d_feat, st.d_cache
    ids, qs = [], []
    sub = None if plan.greedy else split_rows(keys, max(k, 1))
    for i in range(k):
        if plan.greedy:
            d = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # argmax in the draft vocabulary
        else:
            q = draft_probs(logits, st.sampling)
            d = sample(sub[:, i], q)
            qs.append(q)
        ids.append(d)
        if i == k - 1:
            break
        pos = (st.length + i)[:, None]
        normed, feat3, cache = drafter.layer(
            feat[:, None],
            drafter.draft_to_target(d)[:, None],
            pos,
            causal_cache_mask(pos, plan.cache_len, None, ~st.done),
            cache,
            st.length + i,
        )
        logits, feat = drafter.lm_head(normed[:, 0]), feat3[:, 0]
    draft_ids = jnp.stack(ids, axis=1) if ids else jnp.zeros((b, 0), jnp.int32)
    if plan.greedy:
        q = None
    else:
        q = jnp.stack(qs, axis=1) if qs else jnp.zeros((b, 0, st.d_logits.shape[-1]), jnp.float32)
    return drafter.draft_to_target(draft_ids), draft_ids, q, cache


def extend_drafter(
    drafter: Drafter,
    plan: Plan,
    aux: Array,
    next_tokens: Array,
    n: Array,
    length: Array,
    cache,
    live: Array | None = None,
):
    """Feeds the accepted pairs (target feature, next token) at positions length.. into the drafter cache.

    Returns the drafter's logits and feature at the last accepted pair (index n).
    """
    b, w = next_tokens.shape
    pos = length[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
    normed, feat, cache = drafter.layer(
        drafter.fuse(aux.astype(drafter.dtype)),
        next_tokens,
        pos,
        causal_cache_mask(pos, plan.cache_len, None, live),
        cache,
        length,
    )
    normed_n = jnp.take_along_axis(normed, n[:, None, None], axis=1)[:, 0]
    return drafter.lm_head(normed_n), jnp.take_along_axis(feat, n[:, None, None], axis=1)[:, 0], cache


@dataclass(frozen=True)
class RoundOut:
    """What one round computed for every row, before ``one_round`` commits it to the loop state."""

    t_cache: KVCache
    d_cache: Any  # the drafter's cache (None without a drafter)
    accepted: Array  # [B] drafts accepted
    emitted: Array  # [B, W] the accepted drafts, then the bonus token at index ``accepted``
    d_logits: Array | None = None  # the drafter's outputs for the last accepted pair
    d_feat: Array | None = None
    probe: Array | None = None  # rounds without drafts: ``st.probe`` with this round's first-draft score added


def _round_plain(target: Target, plan: Plan, st: LoopState, keys: Array | None) -> RoundOut:
    pos = st.length[:, None]
    hidden, _, t_cache = target_forward(
        target,
        None,
        plan,
        st.pending[:, None],
        pos,
        causal_cache_mask(pos, plan.cache_len, None, ~st.done),
        st.t_cache,
        st.length,
    )
    nxt = pick(target.logits(hidden[:, 0]), plan, st.sampling, keys)
    return RoundOut(t_cache, None, jnp.zeros_like(st.length), nxt[:, None])


def _round_chain(
    target: Target, drafter: Drafter, plan: Plan, st: LoopState, keys: Array | None, k: int, last: Array | None = None
) -> RoundOut:
    """K drafts verified in one target forward of K+1 positions; K = 0 runs one target step and keeps the
    drafter's cache and outputs current, and adds to ``st.probe`` (when the state has one) what its
    first draft would have scored (``probe_acceptance``). ``last``: the run's last round (``plan.lazy_feed``)."""
    b = st.length.shape[0]
    sub = None if plan.greedy else split_rows(keys, 2)
    drafts, draft_ids, q, d_cache = _draft_chain(drafter, plan, st, None if sub is None else sub[:, 0], k)
    block = jnp.concatenate([st.pending[:, None], drafts], axis=1)
    pos = st.length[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    hidden, aux, t_cache = target_forward(
        target, drafter, plan, block, pos, causal_cache_mask(pos, plan.cache_len, None, ~st.done), st.t_cache, st.length
    )
    logits = processed(target.logits(hidden), st.sampling, block, penalties.chain_paths(k + 1))
    if plan.greedy:
        pred = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        n = jnp.sum(jnp.cumprod(drafts == pred[:, :k], axis=1), axis=1).astype(jnp.int32)
        bonus = jnp.take_along_axis(pred, n[:, None], axis=1)[:, 0]
    else:
        t2d_index = drafter.draft_to_target(jnp.arange(drafter.config.draft_vocab_size))
        n, bonus = accept_chain(sub[:, 1], target_probs(logits, st.sampling), q, drafts, draft_ids, t2d_index)
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted = jnp.where(jnp.arange(k + 1)[None, :] == n[:, None], bonus[:, None], padded)
    if k == 0 and plan.lazy_feed:
        d_logits, d_feat, d_cache = _feed_lazily(drafter, plan, st, aux, emitted, d_cache, last)
    else:
        d_logits, d_feat, d_cache = extend_drafter(drafter, plan, aux, emitted, n, st.length, d_cache, ~st.done)
    probe = None
    if k == 0 and st.probe is not None:

        def observe(probe):
            hit = probe_acceptance(drafter, plan, st, logits[:, 0], bonus)
            return probe + jnp.where(~st.done[:, None], jnp.stack([hit, jnp.ones_like(hit)], axis=1), 0.0)

        # Under lazy feeding the carried drafter outputs are current in a run's first round only.
        probe = jax.lax.cond(st.rounds == 0, observe, lambda p: p, st.probe) if plan.lazy_feed else observe(st.probe)
    return RoundOut(t_cache, d_cache, n, emitted, d_logits, d_feat, probe)


def _feed_lazily(drafter: Drafter, plan: Plan, st: LoopState, aux: Array, emitted: Array, cache, last: Array):
    """A round without drafts under ``plan.lazy_feed``: the pair (feature, emitted token) is written into
    the drafter's cache; the drafter's outputs for it are computed in the run's last round only (until
    then the carried ones are stale, and no program reads them)."""
    g = drafter.fuse(aux.astype(drafter.dtype))
    pos = st.length[:, None]
    cache = drafter.write_cache(g, emitted, pos, cache, st.length)

    def outputs(_):  # the pair just written attends over the cache it is in
        normed, feat = drafter.read_cache(
            g, emitted, pos, causal_cache_mask(pos, plan.cache_len, None, ~st.done), cache
        )
        return drafter.lm_head(normed[:, 0]), feat[:, 0]

    d_logits, d_feat = jax.lax.cond(st.rounds == last, outputs, lambda _: (st.d_logits, st.d_feat), None)
    return d_logits, d_feat, cache


def probe_acceptance(drafter: Drafter, plan: Plan, st: LoopState, target_logits: Array, emitted: Array) -> Array:
    """[B] the chance that the drafter's first draft would have been accepted in a round that made none:
    greedy, whether its argmax is the token the target emitted; sampling, sum_x min(p(x), q(x)) (the
    acceptance probability of chain speculative sampling). What ``spec="auto"`` learns acceptance from
    while it decodes without drafts."""
    if plan.greedy:
        return (drafter.draft_to_target(jnp.argmax(st.d_logits, axis=-1).astype(jnp.int32)) == emitted).astype(
            jnp.float32
        )
    q = draft_probs(st.d_logits, st.sampling)
    p = target_probs(target_logits, st.sampling)
    t2d_index = drafter.draft_to_target(jnp.arange(drafter.config.draft_vocab_size))
    return jnp.sum(jnp.minimum(p[:, t2d_index], q), axis=-1)


def _gather_path(cache: KVCache, path: Array, length: Array) -> KVCache:
    """Moves the accepted tree path's KV (slots length + path[j]) to contiguous slots length + j, in the
    leading ``len(length)`` rows of the cache."""
    src = length[:, None] + path  # path[j] >= j: a source is never overwritten before it is read
    b = length.shape[0]

    def move(c):  # c: [B, H, S, D]; the path's entries gathered to [b, T, H, D], as write_kv takes them
        return write_kv(c, jnp.take_along_axis(c[:b], src[:, None, :, None], axis=2).transpose(0, 2, 1, 3), length)

    return KVCache(tuple(move(k) for k in cache.k), tuple(move(v) for v in cache.v))


def _round_tree(target: Target, drafter: Drafter, plan: Plan, st: LoopState, keys: Array | None) -> RoundOut:
    sp_ = plan.spec
    shape = TreeShape(sp_.tree_top_k, sp_.tree_depth, sp_.tree_total_tokens)
    tree, d_cache = grow(drafter, shape, st.d_logits, st.d_feat, st.d_cache, st.length, plan.cache_len, ~st.done)
    tree.tokens = tree.tokens.at[:, 0].set(st.pending)
    pos = st.length[:, None] + tree.depth
    mask = verify_mask(tree, st.length, plan.cache_len) & ~st.done[:, None, None]  # sliding windows: Target.forward
    hidden, aux, t_cache = target_forward(target, drafter, plan, tree.tokens, pos, mask, st.t_cache, st.length)
    # A node's penalties count the drafted nodes on its path (its ancestors and itself, the root, already out, aside).
    on_path = tree.ancestors & (jnp.arange(tree.tokens.shape[1]) > 0)[None, None, :]
    logits = processed(target.logits(hidden), st.sampling, tree.tokens, on_path)
    path, n, bonus = accept_tree(keys, tree, logits, None if plan.greedy else st.sampling, shape)
    t_cache = _gather_path(t_cache, path, st.length)
    path_tokens = jnp.take_along_axis(tree.tokens, path, axis=1)
    w = shape.depth + 1
    emitted = jnp.where(
        jnp.arange(w)[None, :] == n[:, None],
        bonus[:, None],
        jnp.concatenate([path_tokens[:, 1:], path_tokens[:, :1]], axis=1),
    )
    path_aux = jnp.take_along_axis(aux, path[:, :, None], axis=1)
    d_logits, d_feat, d_cache = extend_drafter(drafter, plan, path_aux, emitted, n, st.length, d_cache, ~st.done)
    return RoundOut(t_cache, d_cache, n, emitted, d_logits, d_feat)


def one_round(
    target: Target, drafter: Drafter | None, plan: Plan, st: LoopState, last: Array | None = None
) -> LoopState:
    """draft -> verify -> accept -> cache update for every row; finished rows keep their state. ``last``:
    the index of the run's last round (default ``plan.max_rounds`` - 1), where lazily fed rounds compute
    the drafter's outputs."""
    if plan.greedy:
        key, k_round = st.key, None
    else:
        sub = split_rows(st.key, 2)
        key, k_round = sub[:, 0], sub[:, 1]
    if drafter is None:
        r = _round_plain(target, plan, st, k_round)
    elif plan.spec is None:
        r = _round_chain(
            target, drafter, plan, st, k_round, 0, jnp.int32(plan.max_rounds - 1) if last is None else last
        )
    elif plan.spec.method == "chain":
        r = _round_chain(target, drafter, plan, st, k_round, plan.spec.num_speculative_tokens)
    else:
        r = _round_tree(target, drafter, plan, st, k_round)
    n, emitted = r.accepted, r.emitted
    active = ~st.done
    bonus = jnp.take_along_axis(emitted, n[:, None], axis=1)[:, 0]
    out, n_out, done = emit(st, emitted, n + 1, plan.eos_ids)

    def where_active(new, old):  # active rows take the new value, finished rows keep theirs
        if new is None:
            return None
        return jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)

    return LoopState(
        t_cache=r.t_cache,  # finished rows wrote only past their frozen length
        d_cache=r.d_cache,
        length=jnp.where(active, st.length + n + 1, st.length),
        pending=where_active(bonus, st.pending),
        d_logits=where_active(r.d_logits, st.d_logits),
        d_feat=where_active(r.d_feat, st.d_feat),
        out=out,
        n_out=n_out,
        limit=st.limit,
        done=done,
        # Drafts that became output: a round cut short by EOS or the limit counts what it emitted.
        accepted=st.accepted.at[:, st.rounds].set(jnp.where(active, n_out - st.n_out - 1, -1)),
        rounds=st.rounds + 1,
        sampling=counted(st.sampling, emitted, n_out - st.n_out),
        key=key,
        probe=st.probe if r.probe is None else r.probe,
        ignore_eos=st.ignore_eos,
    )


def run_rounds(target: Target, drafter: Drafter | None, plan: Plan, st: LoopState, limit: Array) -> LoopState:
    """Rounds until every row is done or ``limit`` rounds have run in total (at most ``plan.max_rounds``).
    Attention reads only the cache blocks the rows reach (``layers.softmax_over_blocks``)."""
    stop = jnp.minimum(limit, plan.max_rounds)

    def going(s: LoopState):
        return jnp.any(~s.done) & (s.rounds < stop)

    return jax.lax.while_loop(going, lambda s: one_round(target, drafter, plan, s, stop - 1), st)
