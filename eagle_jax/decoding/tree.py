"""EAGLE-2 dynamic draft trees with static shapes: expansion, selection, masks and acceptance."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from eagle_jax.decoding.sampling import RowSampling, accept_siblings, sample, split_rows, target_probs

Array = jax.Array


@dataclass(frozen=True)
class TreeShape:
    """top_k children per expansion, ``depth`` drafted levels, ``total_tokens`` verified (root included)."""

    top_k: int
    depth: int
    total_tokens: int

    @property
    def expanded_slots(self) -> int:
        """Drafter cache slots used by the expansions (k frontier nodes per level below the last)."""
        return (self.depth - 1) * self.top_k

    @property
    def num_candidates(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k * self.top_k


@jax.tree_util.register_dataclass
@dataclass
class Tree:
    """A verified tree of N = total_tokens nodes; node 0 is the root (the pending token)."""

    tokens: Array  # [B, N] target ids
    parent: Array  # [B, N] node index of the parent (root: 0)
    depth: Array  # [B, N] root 0
    ancestors: Array  # [B, N, N] node i sees node j (ancestor or itself)


def grow(
    drafter,
    shape: TreeShape,
    d_logits: Array,
    d_feat: Array,
    d_cache,
    length: Array,
    cache_len: int,
    live: Array | None = None,
):
    """Drafts a tree from the root's drafter outputs (EAGLE-2): frontier expansion by cumulative log-prob.

    Returns (Tree, drafter cache). Expansion e runs the k frontier nodes at position length + e; they are
    written to drafter slots length + e*k + j and see the prefix plus their own ancestors (masks over the
    ``cache_len`` slots; rows not ``live`` [B] attend to nothing, as in ``engine.causal_cache_mask``).
    """
    k, depth, n_nodes = shape.top_k, shape.depth, shape.total_tokens
    b = d_logits.shape[0]
    s = cache_len
    e_slots = shape.expanded_slots
    to_target = drafter.draft_to_target

    logp = jax.nn.log_softmax(d_logits.astype(jnp.float32), axis=-1)
    score, ids = jax.lax.top_k(logp, k)  # [B, k]
    cand_score, cand_tok, cand_parent, cand_depth = (
        [score],
        [ids],
        [jnp.full((b, k), -1)],
        [jnp.ones((b, k), jnp.int32)],
    )
    front_tok, front_score = ids, score
    front_feat = jnp.broadcast_to(d_feat[:, None, :], (b, k, d_feat.shape[-1]))
    front_cand = jnp.broadcast_to(jnp.arange(k), (b, k))
    front_anc = jnp.zeros((b, k, max(e_slots, 1)), bool)
    rel = jnp.arange(s)[None, :] - length[:, None]  # [B, S]: slot relative to the prefix end
    for e in range(depth - 1):
        vis = front_anc | jax.nn.one_hot(e * k + jnp.arange(k), max(e_slots, 1), dtype=bool)[None]
        tree_vis = jnp.take_along_axis(vis, jnp.clip(rel, 0, e_slots - 1)[:, None, :].repeat(k, 1), axis=2)
        mask = (rel < 0)[:, None, :] | (tree_vis & ((rel >= 0) & (rel < e_slots))[:, None, :])
        if live is not None:
            mask &= live[:, None, None]
        positions = jnp.broadcast_to((length + e)[:, None], (b, k))
        normed, feat, d_cache = drafter.layer(
            front_feat, to_target(front_tok), positions, mask, d_cache, length + e * k
        )
        child_logp = jax.nn.log_softmax(drafter.lm_head(normed).astype(jnp.float32), axis=-1)
        c_lp, c_ids = jax.lax.top_k(child_logp, k)  # [B, k, k]
        c_score = front_score[:, :, None] + c_lp
        base = k + e * k * k
        cand_score.append(c_score.reshape(b, k * k))
        cand_tok.append(c_ids.reshape(b, k * k))
        cand_parent.append(jnp.repeat(front_cand, k, axis=1))
        cand_depth.append(jnp.full((b, k * k), e + 2, jnp.int32))
        front_score, flat = jax.lax.top_k(c_score.reshape(b, k * k), k)
        parent_j = flat // k
        front_tok = jnp.take_along_axis(c_ids.reshape(b, k * k), flat, axis=1)
        front_feat = jnp.take_along_axis(feat, parent_j[:, :, None], axis=1)
        front_anc = jnp.take_along_axis(vis, parent_j[:, :, None], axis=1)
        front_cand = base + flat

    scores = jnp.concatenate(cand_score, axis=1)
    toks = jnp.concatenate(cand_tok, axis=1)
    parents = jnp.concatenate(cand_parent, axis=1)
    depths = jnp.concatenate(cand_depth, axis=1)
    # A child never outscores its parent (log-probs <= 0); the depth penalty breaks ties the same way,
    # so every selected node's parent is selected too.
    ranked = scores - 1e-6 * depths.astype(jnp.float32)
    _, sel = jax.lax.top_k(ranked, n_nodes - 1)
    sel = jnp.sort(sel, axis=1)  # candidate order: parents precede children
    node_of_cand = (
        jnp.zeros((b, scores.shape[1]), jnp.int32).at[jnp.arange(b)[:, None], sel].set(jnp.arange(1, n_nodes))
    )
    sel_parent = jnp.take_along_axis(parents, sel, axis=1)
    parent = jnp.where(sel_parent < 0, 0, jnp.take_along_axis(node_of_cand, jnp.maximum(sel_parent, 0), axis=1))
    parent = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), parent], axis=1)
    tokens = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), to_target(jnp.take_along_axis(toks, sel, axis=1))], axis=1)
    node_depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.take_along_axis(depths, sel, axis=1)], axis=1)
    anc = jnp.broadcast_to(jnp.eye(n_nodes, dtype=bool), (b, n_nodes, n_nodes))
    hop = parent
    for _ in range(depth):
        anc = anc | jax.nn.one_hot(hop, n_nodes, dtype=bool)
        hop = jnp.take_along_axis(parent, hop, axis=1)
    return Tree(tokens, parent, node_depth, anc), d_cache


def verify_mask(tree: Tree, length: Array, cache_len: int) -> Array:
    """[B, N, S]: the prefix (slots < length) plus each node's ancestors at slots length + node."""
    n = tree.tokens.shape[1]
    rel = jnp.arange(cache_len)[None, :] - length[:, None]
    in_tree = (rel >= 0) & (rel < n)
    tree_vis = jnp.take_along_axis(tree.ancestors, jnp.clip(rel, 0, n - 1)[:, None, :].repeat(n, 1), axis=2)
    return (rel < 0)[:, None, :] | (tree_vis & in_tree[:, None, :])


def _children(tree: Tree, node: Array, k: int) -> tuple[Array, Array]:
    """The first k children of ``node`` [B] in node order: (indices [B, k], valid [B, k])."""
    n = tree.tokens.shape[1]
    is_child = (tree.parent == node[:, None]) & (jnp.arange(n)[None, :] > 0)
    rank = jnp.where(is_child, n - jnp.arange(n)[None, :], 0)
    val, idx = jax.lax.top_k(rank, k)
    return idx, val > 0


def accept(
    keys: Array | None, tree: Tree, logits: Array, rs: RowSampling | None, shape: TreeShape
) -> tuple[Array, Array, Array]:
    """Walks the tree from the root: greedy (``rs`` None: match the target argmax) or the lossless
    sibling rule with per-row sampling parameters and keys [B].

    Returns (path [B, depth+1] node indices, root first; n accepted drafts [B]; next token [B]).
    """
    b = logits.shape[0]
    node = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    n = jnp.zeros((b,), jnp.int32)
    path = [node]
    greedy = rs is None
    probs = None if greedy else target_probs(logits, rs)
    pred = jnp.argmax(logits, axis=-1).astype(jnp.int32) if greedy else None
    bonus = jnp.zeros((b,), jnp.int32)
    sub = None if greedy else split_rows(keys, shape.depth + 1)
    for d in range(shape.depth):
        kids, valid = _children(tree, node, shape.top_k)
        kid_tok = jnp.take_along_axis(tree.tokens, kids, axis=1)
        if greedy:
            want = jnp.take_along_axis(pred, node[:, None], axis=1)[:, 0]
            hit = valid & (kid_tok == want[:, None])
            found = jnp.any(hit, axis=1)
            choice = jnp.argmax(hit, axis=1)
            token = want
        else:
            p = jnp.take_along_axis(probs, node[:, None, None], axis=1)[:, 0]
            choice, token = accept_siblings(sub[:, d], p, kid_tok, valid)
            found = choice >= 0
            choice = jnp.maximum(choice, 0)
        stop = alive & ~found
        bonus = jnp.where(stop, token, bonus)
        move = alive & found
        node = jnp.where(move, jnp.take_along_axis(kids, choice[:, None], axis=1)[:, 0], node)
        n = n + move
        alive = move
        path.append(node)
    # Rows that accepted a full-depth path take their bonus from the last node's distribution.
    if greedy:
        last = jnp.take_along_axis(pred, node[:, None], axis=1)[:, 0]
    else:
        last = sample(sub[:, -1], jnp.take_along_axis(probs, node[:, None, None], axis=1)[:, 0])
    bonus = jnp.where(alive, last, bonus)
    return jnp.stack(path, axis=1), n, bonus
