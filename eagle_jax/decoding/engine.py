"""The speculative decoding program: a ``lax.while_loop`` of draft -> verify -> accept rounds (after the
prompt's prefill, ``decoding.prefill``).

Everything here is a pure function of the (target, drafter) modules and arrays, traced once per static
configuration. Caches are addressed by per-row lengths: rejected drafts are rolled back by not moving
the length, never by copying; tree verification writes all nodes past the end and gathers the accepted
path into contiguous slots.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from eagle_jax.config import SpecConfig, aux_layer_ids_for
from eagle_jax.decoding import penalties
from eagle_jax.decoding.sampling import RowSampling, accept_chain, draft_probs, sample, split_rows, target_probs
from eagle_jax.decoding.state import LoopState, counted, emit
from eagle_jax.decoding.tree import TreeShape, accept as accept_tree, grow, verify_mask
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
class RoundCosts:
    """Costs of an adaptive round's parts at a plan's batch and cache length, in seconds, as measured
    in the compiled loop itself (adaptive_costs.calibrate): a round costs ``made x draft_s + verify_s[j]``
    when it makes ``made`` drafts and verifies ``widths[j]`` positions (the drafter's extension over
    them included); ``plain_s`` is a plain round. ``worth_start``: the loop's initial ``worth``
    (below 1: plain rounds from the start, which calibration uses to time them).
    """

    widths: tuple[int, ...]
    verify_s: tuple[float, ...]
    draft_s: float
    plain_s: float
    worth_start: float = 2.0  # optimistic: about five poor rounds in a row, not one, end speculation

    def as_array(self) -> Array:
        """[W + 3] float32: the loop reads the costs as data, so new measurements reuse the compiled
        program; only ``widths`` is part of its shape."""
        return jnp.asarray((*self.verify_s, self.draft_s, self.plain_s, self.worth_start), jnp.float32)


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
    span: int | None = None  # leading cache slots the rounds read and write (None: all of them)
    mesh: Any = None  # tensor parallel: caches are laid out by the sharding rules
    exact: bool = False  # the target computes in float32 whatever its weights' dtype (see ``target_dtype``)
    widths: tuple[int, ...] | None = None  # adaptive chains: the verification widths compiled (RoundCosts.widths)
    # Rounds without drafts (``spec`` None with a drafter) only write the drafter's cache, and compute its
    # outputs (``extend_drafter``) only in a run's last round (``run_rounds``' limit), which leaves them current
    # for the next program; the first draft's acceptance is probed in the first round only. The serving
    # engine's steps: there a run is one step. Feeding the drafter in full every
    # round costs 3-10% of a plain step (the probe's target probabilities at T > 0 the most; BENCHMARKS.md).
    lazy_feed: bool = False

    @classmethod
    def one_shot(cls, batch: int, prompt_len: int, max_new: int, spec: SpecConfig | None, greedy: bool,
                 eos_ids: tuple[int, ...], mesh: Any = None, exact: bool = False) -> "Plan":
        """The plan of ``generate``: prompts padded to ``prompt_len``, ``max_new`` tokens per row."""
        return cls(batch, one_shot_cache_len(prompt_len, max_new, spec), max_new, spec, greedy, eos_ids, None, mesh, exact)

    @property
    def width(self) -> int:
        """Tokens emitted per round at most."""
        return 1 if self.spec is None else self.spec.max_emitted

    @property
    def attend_len(self) -> int:
        return self.cache_len if self.span is None else self.span


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


def causal_cache_mask(q_pos: Array, cache_len: int, window: int | None) -> Array:
    """[B, T, S] for a block at positions q_pos [B, T] over cache slots holding positions 0..S-1."""
    slots = jnp.broadcast_to(jnp.arange(cache_len), (q_pos.shape[0], cache_len))
    return window_mask(q_pos, slots, window)


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
            feat[:, None], drafter.draft_to_target(d)[:, None], pos, causal_cache_mask(pos, plan.attend_len, None), cache, st.length + i
        )
        logits, feat = drafter.lm_head(normed[:, 0]), feat3[:, 0]
    draft_ids = jnp.stack(ids, axis=1) if ids else jnp.zeros((b, 0), jnp.int32)
    if plan.greedy:
        q = None
    else:
        q = jnp.stack(qs, axis=1) if qs else jnp.zeros((b, 0, st.d_logits.shape[-1]), jnp.float32)
    return drafter.draft_to_target(draft_ids), draft_ids, q, cache


def extend_drafter(drafter: Drafter, plan: Plan, aux: Array, next_tokens: Array, n: Array, length: Array, cache):
    """Feeds the accepted pairs (target feature, next token) at positions length.. into the drafter cache.

    Returns the drafter's logits and feature at the last accepted pair (index n).
    """
    b, w = next_tokens.shape
    pos = length[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
    normed, feat, cache = drafter.layer(
        drafter.fuse(aux.astype(drafter.dtype)), next_tokens, pos, causal_cache_mask(pos, plan.attend_len, None), cache, length
    )
    normed_n = jnp.take_along_axis(normed, n[:, None, None], axis=1)[:, 0]
    return drafter.lm_head(normed_n), jnp.take_along_axis(feat, n[:, None, None], axis=1)[:, 0], cache


def _round_plain(target: Target, plan: Plan, st: LoopState, keys: Array | None):
    pos = st.length[:, None]
    hidden, _, t_cache = target_forward(
        target, None, plan, st.pending[:, None], pos, causal_cache_mask(pos, plan.attend_len, target.config.sliding_window), st.t_cache, st.length
    )
    nxt = pick(target.logits(hidden[:, 0]), plan, st.sampling, keys)
    zero = jnp.zeros_like(st.length)
    return t_cache, None, zero, nxt[:, None], None, None


def _round_chain(target: Target, drafter: Drafter, plan: Plan, st: LoopState, keys: Array | None, k: int, last: Array | None = None):
    """K drafts verified in one target forward of K+1 positions; K = 0 runs one target step and keeps the
    drafter's cache and outputs current, and adds to ``st.probe`` (when the state has one) what its
    first draft would have scored (``probe_acceptance``). Returns the new caches, accepted counts,
    emitted tokens, drafter outputs and probe (None when K > 0). ``last``: the run's last round (``plan.lazy_feed``)."""
    b = st.length.shape[0]
    sub = None if plan.greedy else split_rows(keys, 2)
    drafts, draft_ids, q, d_cache = _draft_chain(drafter, plan, st, None if sub is None else sub[:, 0], k)
    block = jnp.concatenate([st.pending[:, None], drafts], axis=1)
    pos = st.length[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    hidden, aux, t_cache = target_forward(
        target, drafter, plan, block, pos, causal_cache_mask(pos, plan.attend_len, target.config.sliding_window), st.t_cache, st.length
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
        d_logits, d_feat, d_cache = extend_drafter(drafter, plan, aux, emitted, n, st.length, d_cache)
    probe = None
    if k == 0 and st.probe is not None:
        def observe(probe):
            hit = probe_acceptance(drafter, plan, st, logits[:, 0], bonus)
            return probe + jnp.where(~st.done[:, None], jnp.stack([hit, jnp.ones_like(hit)], axis=1), 0.0)

        # Under lazy feeding the carried drafter outputs are current in a run's first round only.
        probe = jax.lax.cond(st.rounds == 0, observe, lambda p: p, st.probe) if plan.lazy_feed else observe(st.probe)
    return t_cache, d_cache, n, emitted, d_logits, d_feat, probe


def _feed_lazily(drafter: Drafter, plan: Plan, st: LoopState, aux: Array, emitted: Array, cache, last: Array):
    """A round without drafts under ``plan.lazy_feed``: the pair (feature, emitted token) is written into
    the drafter's cache; the drafter's outputs for it are computed in the run's last round only (until
    then the carried ones are stale, and no program reads them)."""
    g = drafter.fuse(aux.astype(drafter.dtype))
    pos = st.length[:, None]
    cache = drafter.write_cache(g, emitted, pos, cache, st.length)

    def outputs(_):  # the pair just written attends over the cache it is in
        normed, feat = drafter.read_cache(g, emitted, pos, causal_cache_mask(pos, plan.attend_len, None), cache)
        return drafter.lm_head(normed[:, 0]), feat[:, 0]

    d_logits, d_feat = jax.lax.cond(st.rounds == last, outputs, lambda _: (st.d_logits, st.d_feat), None)
    return d_logits, d_feat, cache


def probe_acceptance(drafter: Drafter, plan: Plan, st: LoopState, target_logits: Array, emitted: Array) -> Array:
    """[B] the chance that the drafter's first draft would have been accepted in a round that made none:
    greedy, whether its argmax is the token the target emitted; sampling, sum_x min(p(x), q(x)) (the
    acceptance probability of chain speculative sampling). What ``spec="auto"`` learns acceptance from
    while it decodes without drafts."""
    if plan.greedy:
        return (drafter.draft_to_target(jnp.argmax(st.d_logits, axis=-1).astype(jnp.int32)) == emitted).astype(jnp.float32)
    q = draft_probs(st.d_logits, st.sampling)
    p = target_probs(target_logits, st.sampling)
    t2d_index = drafter.draft_to_target(jnp.arange(drafter.config.draft_vocab_size))
    return jnp.sum(jnp.minimum(p[:, t2d_index], q), axis=-1)


def _costs(plan: Plan, st: LoopState) -> tuple[Array, Array, Array]:
    """(verify_s [W], draft_s, plain_s) from the state's ``RoundCosts.as_array``."""
    w = len(plan.widths)
    return st.costs[:w], st.costs[w], st.costs[w + 1]


def draft_confidence(logits: Array) -> Array:
    """The drafter's estimate that its top draft is accepted, from its logits [B, Vd]: the top-1
    share of the top two probabilities, q1 / (q1 + q2). Not q1 itself: a drafter trained to match the
    target's whole distribution is often right with q1 ~ 0.1 over a flat tail (held-out code, bundled
    pair: greedy acceptance 0.58 at shares 0.50-0.56, 0.87 at 0.56-0.67, >= 0.97 above; by q1
    quintile it varied only between 0.80 and 0.99)."""
    top2 = jax.lax.top_k(logits.astype(jnp.float32), 2)[0]
    return jax.nn.sigmoid(top2[:, 0] - top2[:, 1])  # q1 / (q1 + q2) = 1 / (1 + exp(l2 - l1))


def _draft_adaptive(drafter: Drafter, plan: Plan, st: LoopState, keys: Array | None, k: int):
    """Up to K chain drafts, stopping once every further one is worth less than it costs.

    A draft's worth is its chance of acceptance, estimated by the drafter's cumulative confidence c_i
    (the product of ``draft_confidence`` over drafts 0..i): drafting step i+1 goes on while the rows'
    summed c_i, in tokens at the cost per token of a plain round, exceeds one drafter step. The rule
    reads only the drafter, so speculative sampling stays lossless. Returns (draft target ids [B,K],
    draft ids [B,K], q [B,K,Vd] or None, cumulative confidence [B,K] (0 past the drafts made),
    number of drafts made [], drafter cache).
    """
    verify_s, draft_s, _ = _costs(plan, st)
    b = st.length.shape[0]
    active = ~st.done
    sub = None if plan.greedy else split_rows(keys, k)
    token_s = verify_s[0] / b  # what one emitted token costs in a width-1 round

    def pick_draft(logits, i):
        if plan.greedy:
            d = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            q = None
        else:
            q = draft_probs(logits, st.sampling)
            d = sample(sub[:, i], q)
        return d, q, draft_confidence(logits)

    d, q, conf = pick_draft(st.d_logits, 0)
    ids, qs, confs = [d], [q], [jnp.where(active, conf, 0.0)]
    logits, feat, cache, made = st.d_logits, st.d_feat, st.d_cache, jnp.int32(1)
    for i in range(1, k):
        go = (made == i) & (jnp.sum(confs[-1]) * token_s > draft_s)

        def step(args, i=i):
            feat, cache, d = args
            pos = (st.length + i - 1)[:, None]
            normed, feat3, cache = drafter.layer(
                feat[:, None], drafter.draft_to_target(d)[:, None], pos, causal_cache_mask(pos, plan.attend_len, None), cache, st.length + i - 1
            )
            return drafter.lm_head(normed[:, 0]), feat3[:, 0], cache

        def skip(args):
            feat, cache, _ = args
            return logits, feat, cache

        logits, feat, cache = jax.lax.cond(go, step, skip, (feat, cache, ids[-1]))
        d, q, conf = pick_draft(logits, i)
        ids.append(jnp.where(go, d, 0))
        qs.append(q)
        confs.append(jnp.where(go, confs[-1] * conf, 0.0))
        made = made + go.astype(jnp.int32)
    draft_ids = jnp.stack(ids, axis=1)
    q = None if plan.greedy else jnp.stack(qs, axis=1)
    return drafter.draft_to_target(draft_ids), draft_ids, q, jnp.stack(confs, axis=1), made, cache


def _round_adaptive(target: Target, drafter: Drafter, plan: Plan, st: LoopState, keys: Array | None):
    """An adaptive chain round: up to K drafts (``_draft_adaptive``), then verification at the static
    width that maximises expected tokens per second, ``lax.switch`` over the precompiled widths (rows
    share the widest); the drafter's extension runs at the same width."""
    verify_s, draft_s, _ = _costs(plan, st)
    k = plan.spec.num_speculative_tokens
    b = st.length.shape[0]
    sub = None if plan.greedy else split_rows(keys, 2)
    drafts, draft_ids, q, conf, made, d_cache = _draft_adaptive(drafter, plan, st, None if sub is None else sub[:, 0], k)
    # Expected emitted tokens for each width: every active row gets 1, plus its drafts' confidences.
    active = ~st.done
    widths = jnp.asarray(plan.widths)
    gain = jnp.sum(jnp.where(active[:, None], jnp.cumsum(conf, axis=1), 0.0), axis=0)  # [K]: drafts 0..i
    gain = jnp.concatenate([jnp.zeros((1,)), gain])[jnp.minimum(widths - 1, made)]
    expected = jnp.sum(active) + gain
    j = jnp.argmax(expected / (made * draft_s + verify_s))
    proposed = jnp.minimum(widths[j] - 1, made)
    block = jnp.concatenate([st.pending[:, None], drafts], axis=1)
    pos = st.length[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]

    def verify(w):
        def run(t_cache):
            hidden, aux, t_cache = target_forward(
                target, drafter, plan, block[:, :w], pos[:, :w], causal_cache_mask(pos[:, :w], plan.attend_len, target.config.sliding_window),
                t_cache, st.length,
            )
            pad = ((0, 0), (0, k + 1 - w), (0, 0))
            return jnp.pad(target.logits(hidden), pad), jnp.pad(aux, pad), t_cache

        return run

    logits, aux, t_cache = jax.lax.switch(j, [verify(w) for w in plan.widths], st.t_cache)
    logits = processed(logits, st.sampling, block, penalties.chain_paths(k + 1))
    if plan.greedy:
        pred = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        match = (drafts == pred[:, :k]) & (jnp.arange(k)[None, :] < proposed)
        n = jnp.sum(jnp.cumprod(match, axis=1), axis=1).astype(jnp.int32)
        bonus = jnp.take_along_axis(pred, n[:, None], axis=1)[:, 0]
    else:
        t2d_index = drafter.draft_to_target(jnp.arange(drafter.config.draft_vocab_size))
        n, bonus = accept_chain(
            sub[:, 1], target_probs(logits, st.sampling), q, drafts, draft_ids, t2d_index, jnp.broadcast_to(proposed, (b,))
        )
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted = jnp.where(jnp.arange(k + 1)[None, :] == n[:, None], bonus[:, None], padded)

    def extend(w):
        def run(d_cache):
            return extend_drafter(drafter, plan, aux[:, :w], emitted[:, :w], n, st.length, d_cache)

        return run

    d_logits, d_feat, d_cache = jax.lax.switch(j, [extend(w) for w in plan.widths], d_cache)
    return t_cache, d_cache, n, emitted, d_logits, d_feat, made * draft_s + verify_s[j]


WORTH_KEEP = 0.8  # weight of the past in the running average of worth


def _round_adaptive_or_plain(target: Target, drafter: Drafter, plan: Plan, st: LoopState, keys: Array | None):
    """An adaptive round while speculation has paid (``st.worth`` >= 1), else a plain target step.

    Worth compares this round's emitted tokens per modelled second with plain decoding's (the
    calibrated ``plain_s`` per step), averaged over rounds. Once it falls below 1 the rest of the run
    decodes plainly: the drafter's cache then falls behind, so there is no way back within a run,
    and a prompt the drafter cannot follow costs a few rounds more than plain decoding, not the run.
    """
    _, _, plain_s = _costs(plan, st)
    k = plan.spec.num_speculative_tokens
    active = ~st.done

    def speculate(st):
        t_cache, d_cache, n, emitted, d_logits, d_feat, round_s = _round_adaptive(target, drafter, plan, st, keys)
        tokens = jnp.sum(jnp.where(active, n + 1, 0))
        ratio = (tokens / round_s) / (jnp.maximum(jnp.sum(active), 1) / plain_s)
        return t_cache, d_cache, n, emitted, d_logits, d_feat, WORTH_KEEP * st.worth + (1 - WORTH_KEEP) * ratio

    def plain(st):
        t_cache, _, n, emitted, _, _ = _round_plain(target, plan, st, keys)
        return t_cache, st.d_cache, n, jnp.pad(emitted, ((0, 0), (0, k))), st.d_logits, st.d_feat, st.worth

    return jax.lax.cond(st.worth >= 1.0, speculate, plain, st)


def _gather_path(cache: KVCache, path: Array, length: Array) -> KVCache:
    """Moves the accepted tree path's KV (slots length + path[j]) to contiguous slots length + j, in the
    leading ``len(length)`` rows of the cache."""
    src = length[:, None] + path  # path[j] >= j: a source is never overwritten before it is read
    b = length.shape[0]

    def move(c):  # c: [B, H, S, D]; the path's entries gathered to [b, T, H, D], as write_kv takes them
        return write_kv(c, jnp.take_along_axis(c[:b], src[:, None, :, None], axis=2).transpose(0, 2, 1, 3), length)

    return KVCache(tuple(move(k) for k in cache.k), tuple(move(v) for v in cache.v))


def _round_tree(target: Target, drafter: Drafter, plan: Plan, st: LoopState, keys: Array | None):
    sp_ = plan.spec
    span = plan.attend_len
    shape = TreeShape(sp_.tree_top_k, sp_.tree_depth, sp_.tree_total_tokens)
    tree, d_cache = grow(drafter, shape, st.d_logits, st.d_feat, st.d_cache, st.length, span)
    tree.tokens = tree.tokens.at[:, 0].set(st.pending)
    pos = st.length[:, None] + tree.depth
    mask = verify_mask(tree, st.length, span)
    if target.config.sliding_window is not None:
        mask &= causal_cache_mask(pos, span, target.config.sliding_window) | (jnp.arange(span) >= st.length[:, None])[:, None, :]
    hidden, aux, t_cache = target_forward(target, drafter, plan, tree.tokens, pos, mask, st.t_cache, st.length)
    # A node's penalties count the drafted nodes on its path (its ancestors and itself, the root, already out, aside).
    on_path = tree.ancestors & (jnp.arange(tree.tokens.shape[1]) > 0)[None, None, :]
    logits = processed(target.logits(hidden), st.sampling, tree.tokens, on_path)
    path, n, bonus = accept_tree(keys, tree, logits, None if plan.greedy else st.sampling, shape)
    t_cache = _gather_path(t_cache, path, st.length)
    path_tokens = jnp.take_along_axis(tree.tokens, path, axis=1)
    w = shape.depth + 1
    emitted = jnp.where(jnp.arange(w)[None, :] == n[:, None], bonus[:, None], jnp.concatenate([path_tokens[:, 1:], path_tokens[:, :1]], axis=1))
    path_aux = jnp.take_along_axis(aux, path[:, :, None], axis=1)
    d_logits, d_feat, d_cache = extend_drafter(drafter, plan, path_aux, emitted, n, st.length, d_cache)
    return t_cache, d_cache, n, emitted, d_logits, d_feat


def one_round(target: Target, drafter: Drafter | None, plan: Plan, st: LoopState, last: Array | None = None) -> LoopState:
    """draft -> verify -> accept -> cache update for every row; finished rows keep their state. ``last``:
    the index of the run's last round (default ``plan.max_rounds`` - 1), where lazily fed rounds compute
    the drafter's outputs."""
    if plan.greedy:
        key, k_round = st.key, None
    else:
        sub = split_rows(st.key, 2)
        key, k_round = sub[:, 0], sub[:, 1]
    worth, probe = st.worth, st.probe
    if drafter is None:
        t_cache, d_cache, n, emitted, d_logits, d_feat = _round_plain(target, plan, st, k_round)
    elif plan.spec is None:
        last = jnp.int32(plan.max_rounds - 1) if last is None else last
        t_cache, d_cache, n, emitted, d_logits, d_feat, probe = _round_chain(target, drafter, plan, st, k_round, 0, last)
    elif plan.spec.adaptive:
        t_cache, d_cache, n, emitted, d_logits, d_feat, worth = _round_adaptive_or_plain(target, drafter, plan, st, k_round)
    elif plan.spec.method == "chain":
        t_cache, d_cache, n, emitted, d_logits, d_feat, _ = _round_chain(target, drafter, plan, st, k_round, plan.spec.num_speculative_tokens)
    else:
        t_cache, d_cache, n, emitted, d_logits, d_feat = _round_tree(target, drafter, plan, st, k_round)
    active = ~st.done
    bonus = jnp.take_along_axis(emitted, n[:, None], axis=1)[:, 0]
    out, n_out, done = emit(st, emitted, n + 1, plan.eos_ids)

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
        limit=st.limit,
        done=done,
        # Drafts that became output: a round cut short by EOS or the limit counts what it emitted.
        accepted=st.accepted.at[:, st.rounds].set(jnp.where(active, n_out - st.n_out - 1, -1)),
        rounds=st.rounds + 1,
        sampling=counted(st.sampling, emitted, n_out - st.n_out),
        key=key,
        worth=worth,
        costs=st.costs,
        probe=probe,
        ignore_eos=st.ignore_eos,
    )


SPAN_MIN_CACHE = 1024  # caches from this many slots decode in growing spans (``growing_spans``)
SPAN_ALIGN = 128


def growing_spans(plan: Plan) -> tuple[int, ...]:
    """Spans (leading cache slots read) of the loop's first phases, before the whole cache.

    Attention reads every slot it is given, used or not (about 2 us per slot and step for the bundled
    target on a CPU core), so a one-shot cache sized for prompt + max_new costs a short row as much as
    a full one. From SPAN_MIN_CACHE slots the rounds run in phases: while every active row fits in a
    quarter, then a half of the cache, they read only that; then all of it. Each phase is a copy of
    the round in the program (compile time), hence only for large caches. Spans the prompts already
    fill are skipped (the prompt length is the plan's cache length less max_new and the scratch)."""
    if plan.span is not None or plan.cache_len < SPAN_MIN_CACHE:
        return ()
    prompt_len = plan.cache_len - plan.max_rounds - scratch_slots(plan.spec) - 1
    spans = {-(-plan.cache_len // (4 // f) // SPAN_ALIGN) * SPAN_ALIGN for f in (1, 2)}
    return tuple(sorted(s for s in spans if prompt_len + 2 * (scratch_slots(plan.spec) + 1) <= s < plan.cache_len))


WATCH_MIN_ROUNDS = 4  # a watched chunk runs at least this many rounds (``departed``)
WATCH_Z = 1.0  # ... and ends once its rows' mean leaves the band by this many standard errors
# ... or one row's own mean falls below its end of the band by this many of that row's: tested on each row, every
# round, a looser test would end chunks on noise
WATCH_ROW_Z = 2.0


def departed(st: LoopState, start: Array, watch: Array) -> Array:
    """Whether the rounds since round ``start`` accepted drafts outside the band their choice assumed
    (``autospec.watch``): over the n row-rounds that ran, the mean is below lo or above hi (``watch[0]`` = (lo,
    hi, sd) of drafts accepted per row and round) by more than WATCH_Z sd / sqrt(n), a departure, not the noise
    of a few rounds; or a row's own mean, over its n_b rounds, is below its lo (``watch[1 + b]`` = (lo, _, sd)) by
    more than WATCH_ROW_Z sd / sqrt(n_b): the slowest row sets when a batch ends."""
    r = jnp.arange(st.accepted.shape[1])[None, :]
    ran = (r >= start) & (r < st.rounds) & (st.accepted >= 0)
    got = jnp.where(ran, st.accepted, 0).astype(jnp.float32)
    n_row = ran.sum(axis=1)
    n = jnp.maximum(n_row.sum(), 1).astype(jnp.float32)
    mean = got.sum() / n
    off = jnp.maximum(watch[0, 0] - mean, mean - watch[0, 1])
    each = jnp.maximum(n_row, 1).astype(jnp.float32)
    short = (watch[1:, 0] - got.sum(axis=1) / each > WATCH_ROW_Z * watch[1:, 2] / jnp.sqrt(each)) & (n_row >= WATCH_MIN_ROUNDS)
    return (st.rounds - start >= WATCH_MIN_ROUNDS) & ((off > WATCH_Z * watch[0, 2] / jnp.sqrt(n)) | jnp.any(short))


def run_rounds(target: Target, drafter: Drafter | None, plan: Plan, st: LoopState, limit: Array,
               watch: Array | None = None) -> LoopState:
    """Rounds until every row is done or ``limit`` rounds have run in total (at most ``plan.max_rounds``);
    for large caches, the first ones over the leading slots only (``growing_spans``). A round's span
    changes what attention reads, never the tokens: slots past a row's length are masked either way.
    ``watch`` (``departed``): the rounds also stop once their acceptance departs from what was expected
    (``spec="auto"``: a chunk can then run long, since it ends where its choice should be made again)."""
    stop = jnp.minimum(limit, plan.max_rounds)
    start = st.rounds
    scratch = scratch_slots(plan.spec) + 1

    def going(s: LoopState):
        on = jnp.any(~s.done) & (s.rounds < stop)
        return on if watch is None else on & ~departed(s, start, watch)

    for span in growing_spans(plan):
        phase = dataclasses.replace(plan, span=span)

        def fits(s: LoopState, span=span):  # every active row's writes this round stay below the span
            return going(s) & (jnp.max(jnp.where(s.done, 0, s.length)) + scratch <= span)

        st = jax.lax.while_loop(fits, lambda s, phase=phase: one_round(target, drafter, phase, s, stop - 1), st)

    return jax.lax.while_loop(going, lambda s: one_round(target, drafter, plan, s, stop - 1), st)
