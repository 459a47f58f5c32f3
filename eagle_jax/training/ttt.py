"""Training-time test (TTT): the drafter unrolled over its own features, and its loss.

Data layout. ``input_ids`` [B, T] are the tokens of the training sequence; the frozen target gives, at
every position t, its aux states (feature_t) and logits (its distribution for token t+1). The pair at
draft index t is (feature_t, token_{t+1}) and it is supervised by the target's distribution for token
t+2, i.e. ``target_logits[t+1]``. Step i of the unroll moves everything i positions further:

- step 0 reads the fused target features; step i > 0 reads the features the drafter produced at step
  i-1 at the SAME index (pre-norm h2 for EAGLE-3, RMSNorm_final(h2) with ``norm_output``, EAGLE-3.1);
- its token at index j is input_ids[j+1+i], its RoPE position is j+i, its target is
  target_logits[j+1+i] and its loss mask loss_mask[j+1+i] (zero past the end of the sequence);
- its query at index j attends over the step-0 keys 0..j (causal) plus the single key of every step
  s = 1..i at index j (the "diagonal"), in ONE fp32 softmax over all of them.

The attention never builds anything larger than [B, heads, T, T + ttt_length] (step-0 scores plus one
column per diagonal key), so memory grows as T x (T + steps), not T x (T * steps).

Packed rows (several documents per row, ``data.batching: pack``): ``positions`` restart at 0 at each
document and ``segment_ids`` number them (0 = padding). Step-0 keys are then those of the query's own
document (causal by position, same segment); the diagonal keys share the query's index, hence its
document; RoPE positions are the restarted ones (+ i at step i); and a (step, index) whose target
position j+1+i lies in another document is out of the loss, so the last tokens of a document are
never supervised by the next one's first tokens. Every supervised number then equals the one of the
document alone in its own row. Without them: one sequence per row at positions 0..T-1.

``remat``: each TTT step (its layer, lm_head and loss) runs under ``jax.checkpoint``, so the backward
pass recomputes a step instead of keeping its activations (attention probabilities, [B,T,Vd] logits)
for all steps at once: memory for long sequences, same loss and gradients, ~1 more forward of compute.

Loss of step i: p = softmax(target_logits restricted to the draft vocabulary) in fp32,
mask = loss_mask * [target's argmax is a draft token], l_i = -sum(mask * p . log_softmax(draft_logits)),
total = sum_i decay^i * l_i. Normalisation (``normalize``):

- "all": each l_i is divided by B*T, every position counted, padded or not (the EAGLE reference);
- "valid": by the number of positions with mask == 1 at that step (TorchSpec); independent of padding.

"valid" is a per-token mean over the batch, so packing leaves it unchanged. "all" is that mean times the
fraction of the batch's B*T positions that are supervised, which packing raises (less padding): the
same documents give a larger "all" loss packed than padded one per row, and only loss * B*T (the
per-step sum) is unchanged. Compare losses across batching modes with "valid".
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from eagle_jax.modeling.drafter import Drafter
from eagle_jax.modeling.layers import causal_mask, document_mask

Array = jax.Array

NORMALIZATIONS = ("all", "valid")
ACC_DENOMINATORS = ("mask", "loss_mask")


class TTTOutput(NamedTuple):
    """``total`` = sum_i decay^i * losses[i]; per-step ``losses``, ``accuracies`` and ``counts`` [steps].

    counts[i] = number of supervised positions (mask == 1) at step i, for weighting across batches.
    """

    total: Array
    losses: Array
    accuracies: Array
    counts: Array


def shift_left(x: Array, n: int = 1) -> Array:
    """Shifts along axis 1 left by ``n``, zero-padding the end (tokens 0, mask 0)."""
    if n == 0:
        return x
    pad = jnp.zeros((x.shape[0], n) + x.shape[2:], x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)


def _qkv(drafter: Drafter, g: Array, tokens: Array, positions: Array) -> tuple[Array, Array, Array]:
    """The drafter layer's per-head projections for pairs (g, token): q [B,T,Hq,Dqk], k [B,T,Hkv,Dqk],
    v [B,T,Hkv,Dv], q and k rotated (MLA: keys and values expanded from the latents, Hkv = Hq)."""
    u, cos, sin = drafter.attention_input(g, tokens, positions)
    return drafter.self_attn.heads(u, cos, sin)


def _finish(drafter: Drafter, g: Array, attn_out: Array) -> tuple[Array, Array]:
    """attn_out [B,T,Hq*Dv] -> (draft logits [B,T,Vd], feature for the next step [B,T,H])."""
    normed, nxt = drafter.finish(g, drafter.self_attn.o_proj(attn_out))
    return drafter.lm_head(normed), nxt


def _extended_attention(
    q: Array,
    k0: Array,
    v0: Array,
    diag_k: Array,
    diag_v: Array,
    n_diag: Array | int,
    scale: float,
    mask: Array | None = None,
) -> Array:
    """Query j attends over step-0 keys 0..j and the diagonal keys (index j) of the later steps.

    q: [B,T,Hq,D]; k0: [B,T,Hkv,D], v0: [B,T,Hkv,Dv]; diag_k/diag_v: [S,B,T,Hkv,D/Dv], the keys/values
    of steps 1..S, of which the first ``n_diag`` are valid (the rest are masked out). Scores are q.k *
    ``scale`` (1/sqrt(D) for GQA, MLA's softmax scale). ``mask`` [B,T,T] (query, step-0 key): None =
    causal; ``document_mask`` for packed rows. Returns [B,T,Hq*Dv].
    """
    b, t, hq, d = q.shape
    hkv = k0.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    neg = jnp.finfo(jnp.float32).min
    mask = causal_mask(b, t) if mask is None else mask
    s0 = jnp.einsum("btkgd,bskd->bkgts", qg, k0, preferred_element_type=jnp.float32) * scale
    s0 = jnp.where(mask[:, None, None], s0, neg)
    sd = jnp.einsum("btkgd,nbtkd->bkgtn", qg, diag_k, preferred_element_type=jnp.float32) * scale
    sd = jnp.where(jnp.arange(diag_k.shape[0]) < n_diag, sd, neg)
    probs = jax.nn.softmax(jnp.concatenate([s0, sd], axis=-1), axis=-1).astype(v0.dtype)  # [B,kv,g,T,T+S]
    out = jnp.einsum("bkgts,bskd->btkgd", probs[..., :t], v0)
    out = out + jnp.einsum("bkgtn,nbtkd->btkgd", probs[..., t:], diag_v)
    return out.reshape(b, t, hq * v0.shape[-1])


def _unroll(
    drafter: Drafter,
    aux: Array,
    input_ids: Array,
    ttt_length: int,
    per_step: Callable[[Array, Array], Any],
    positions: Array | None = None,
    segment_ids: Array | None = None,
    remat: bool = False,
) -> Any:
    """Runs the unroll; returns ``per_step(i, logits_i)`` of every step, stacked on a leading axis.

    Steps 1.. run in a ``lax.scan`` (compile time independent of ttt_length); the diagonal keys live
    in a fixed [ttt_length-1, B, T, Hkv, D] buffer filled one slot per step. An MLA drafter's keys and
    values are the expanded per-head ones (training has no latent cache to save). ``positions`` /
    ``segment_ids`` [B,T]: packed rows (module docstring); ``remat``: every step under jax.checkpoint.
    """
    b, t = input_ids.shape
    dtype = drafter.fc.kernel[...].dtype
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = causal_mask(b, t) if segment_ids is None else document_mask(positions, segment_ids)
    scale = drafter.self_attn.scale
    n = max(ttt_length - 1, 1)

    def first(aux, tokens):
        g = drafter.fuse(aux.astype(dtype))
        q, k0, v0 = _qkv(drafter, g, tokens, positions)
        diag_k = jnp.zeros((n,) + k0.shape, k0.dtype)
        diag_v = jnp.zeros((n,) + v0.shape, v0.dtype)
        logits, g = _finish(drafter, g, _extended_attention(q, k0, v0, diag_k, diag_v, 0, scale, mask))
        return (g, k0, v0, diag_k, diag_v), per_step(jnp.int32(0), logits)

    tokens = shift_left(input_ids)  # pair feature_t with token_{t+1}
    (g, k0, v0, diag_k, diag_v), out0 = (jax.checkpoint(first) if remat else first)(aux, tokens)
    if ttt_length == 1:
        return jax.tree.map(lambda x: x[None], out0)

    def body(carry, i):
        g, tokens, diag_k, diag_v = carry
        tokens = shift_left(tokens)  # one token further along than step i-1
        q, k, v = _qkv(drafter, g, tokens, positions + i)  # step i sits i positions further along
        diag_k = jax.lax.dynamic_update_index_in_dim(diag_k, k, i - 1, 0)
        diag_v = jax.lax.dynamic_update_index_in_dim(diag_v, v, i - 1, 0)
        logits, g = _finish(drafter, g, _extended_attention(q, k0, v0, diag_k, diag_v, i, scale, mask))
        return (g, tokens, diag_k, diag_v), per_step(i, logits)

    if remat:  # inside a scan, CSE cannot merge the recomputation away: no need to prevent it
        body = jax.checkpoint(body, prevent_cse=False)
    _, rest = jax.lax.scan(body, (g, tokens, diag_k, diag_v), jnp.arange(1, ttt_length, dtype=jnp.int32))
    return jax.tree.map(lambda a, r: jnp.concatenate([a[None], r], axis=0), out0, rest)


def ttt_unroll(
    drafter: Drafter,
    aux: Array,
    input_ids: Array,
    ttt_length: int = 7,
    *,
    positions: Array | None = None,
    segment_ids: Array | None = None,
) -> Array:
    """Draft logits [ttt_length, B, T, Vd]; index j of step i predicts token j+i+2 (of its document)."""
    return _unroll(drafter, aux, input_ids, ttt_length, lambda i, logits: logits, positions, segment_ids)


def _shift_dynamic(x: Array, n: Array) -> Array:
    """x[:, n:] moved to the front (axis 1); the wrapped tail is garbage the caller masks out."""
    return jnp.roll(x, -n, axis=1)


def ttt_loss(
    drafter: Drafter,
    aux: Array,
    input_ids: Array,
    target_logits: Array,
    loss_mask: Array,
    *,
    ttt_length: int = 7,
    decay: float = 0.8,
    normalize: str = "all",
    acc_denominator: str = "mask",
    positions: Array | None = None,
    segment_ids: Array | None = None,
    remat: bool = False,
    target_argmax: Array | None = None,
) -> TTTOutput:
    """The TTT loss (see the module docstring for the alignment).

    aux [B,T,N*Ht] and target_logits [B,T,V] from the frozen target on ``input_ids`` [B,T];
    or, with ``target_argmax`` [B,T] (the target's argmax over its whole vocabulary), target_logits
    [B,T,Vd] already restricted to the draft vocabulary in draft-id order (precomputed features,
    ``training.features``): the same loss without the full-vocabulary logits;
    loss_mask [B,T] is 1 on tokens to learn (assistant tokens), aligned with input_ids.
    ``positions`` / ``segment_ids`` [B,T]: packed rows, several documents per row (the target's
    outputs must come from the same document-aware forward); None = one sequence per row.
    ``remat``: recompute each step in the backward pass instead of storing it (same numbers).
    ``normalize``: "all" (divide by B*T, EAGLE reference) or "valid" (by the step's masked count,
    TorchSpec). Accuracy of step i = draft argmax == target argmax (in draft-id space) over positions
    with mask == 1, divided by their count ("mask") or by the shifted loss_mask count ("loss_mask",
    as the EAGLE reference reports it: a target argmax outside the draft vocabulary counts as wrong).
    Each step's loss is computed inside the unroll, so the step logits are never stacked.
    """
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"ttt_loss: normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
    if acc_denominator not in ACC_DENOMINATORS:
        raise ValueError(f"ttt_loss: acc_denominator must be one of {ACC_DENOMINATORS}, got {acc_denominator!r}")
    b, t = input_ids.shape
    vd = drafter.config.draft_vocab_size

    # Computed once for every target position; step i reads them i+1 positions further on.
    # d2t is sorted, so gathering the used ids keeps draft-id order: column i = draft id i.
    tl = jax.lax.stop_gradient(target_logits).astype(jnp.float32)
    if target_argmax is None:
        used = jnp.arange(vd) + drafter.d2t[...]
        target_argmax, tl = jnp.argmax(tl, axis=-1), jnp.take(tl, used, axis=-1)
    elif tl.shape[-1] != vd:
        raise ValueError(
            f"ttt_loss: with target_argmax, target_logits must hold the {vd} draft-vocabulary columns, got "
            f"{tl.shape[-1]}"
        )
    p_all = jax.nn.softmax(tl, axis=-1)  # [B,T,Vd]
    p_arg = jnp.argmax(p_all, axis=-1)
    lmask_all = loss_mask.astype(jnp.float32)
    mask_all = lmask_all * drafter.t2d[...][target_argmax].astype(jnp.float32)
    seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids

    def per_step(i, logits):
        o = i + 1  # index j of step i is supervised by target position j + 1 + i
        # Zero past the end of the row and where j + 1 + i is in the next document.
        valid = ((jnp.arange(t) < t - o)[None, :] & (_shift_dynamic(seg, o) == seg)).astype(jnp.float32)
        lmask = _shift_dynamic(lmask_all, o) * valid
        mask = _shift_dynamic(mask_all, o) * valid
        logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        per_pos = -jnp.sum(_shift_dynamic(p_all, o) * logq, axis=-1)  # cross-entropy against the soft target
        count = jnp.sum(mask)
        denom = jnp.float32(b * t) if normalize == "all" else jnp.maximum(count, 1.0)
        loss = jnp.sum(mask * per_pos) / denom
        correct = (jnp.argmax(logits, axis=-1) == _shift_dynamic(p_arg, o)).astype(jnp.float32)
        acc_den = count if acc_denominator == "mask" else jnp.sum(lmask)
        acc = jax.lax.stop_gradient(jnp.sum(correct * mask) / jnp.maximum(acc_den, 1.0))
        return loss, acc, count

    losses, accs, counts = _unroll(drafter, aux, input_ids, ttt_length, per_step, positions, segment_ids, remat)
    total = jnp.sum(losses * decay ** jnp.arange(ttt_length, dtype=jnp.float32))
    return TTTOutput(total, losses, accs, counts)


def simulated_acceptance_length(accuracies) -> Array:
    """Expected tokens per target forward of a chain of ``len(accuracies)`` drafts.

    acc_i is the accuracy of step i given that the tokens before it were right (TTT feeds the true
    tokens), so draft k is accepted with probability prod_{i<=k} acc_i and
    AL = 1 + sum_k prod_{i<=k} acc_i (the 1 is the target's own bonus token, counted once).
    """
    acc = jnp.asarray(accuracies, jnp.float32)
    return 1.0 + jnp.sum(jnp.cumprod(acc))
