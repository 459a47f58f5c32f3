"""The loop state of speculative decoding: one small pytree carried through ``lax.while_loop``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from eagle_jax.decoding.sampling import RowSampling
from eagle_jax.modeling.target import KVCache

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclass
class LoopState:
    """Per-row decoding state; every array has the batch (or slot) on axis 0 except ``rounds``.

    Invariant at the start of a round: the target cache holds positions 0..length-1; ``pending`` is the
    last emitted token (position ``length``), not yet run by the target; the drafter cache holds the
    pairs (target feature g_t, token x_{t+1}) for t < length, and ``d_logits``/``d_feat`` are the
    drafter's outputs for the last pair (t = length-1), predicting the token after ``pending``.
    """

    t_cache: KVCache
    d_cache: tuple[Array, Array] | None
    length: Array  # [B] int32
    pending: Array  # [B] int32
    d_logits: Array | None  # [B, Vd]
    d_feat: Array | None  # [B, H]
    out: Array  # [B, W] emitted tokens
    n_out: Array  # [B] int32 tokens in ``out``
    limit: Array  # [B] int32: the row is done once n_out reaches it (max_new_tokens)
    done: Array  # [B] bool
    accepted: Array  # [B, max_rounds] drafts accepted per round; -1 where the row did not run
    rounds: Array  # [] int32
    sampling: RowSampling  # per-row temperature / top_k / top_p (unused by greedy programs)
    key: Array  # [B] one PRNG key per row
    # spec="auto" and serving: per row, (summed acceptance chance of the drafter's first draft, rounds)
    # over rounds that made no drafts (engine ``probe_acceptance``): acceptance observed while not speculating.
    probe: Array | None = None  # [B, 2] float32
    # Serving: rows that generate through EOS (``ignore_eos``) as data, so one program serves both kinds.
    ignore_eos: Array | None = None  # [B] bool; None: every row stops at EOS


def emit(state: LoopState, tokens: Array, count: Array, eos_ids: tuple[int, ...]) -> tuple[Array, Array, Array]:
    """Appends tokens[:, :count] to each active row's output; stops rows at EOS or at their ``limit``.

    Returns (out, n_out, done). Tokens after an EOS or past the limit are not emitted (n_out - the old
    n_out is what a row really produced this round).
    """
    b, w = tokens.shape
    idx = jnp.arange(w)
    valid = idx[None, :] < count[:, None]
    if eos_ids:
        is_eos = valid & jnp.isin(tokens, jnp.asarray(eos_ids, tokens.dtype))
        if state.ignore_eos is not None:
            is_eos &= ~state.ignore_eos[:, None]
        first_eos = jnp.min(jnp.where(is_eos, idx[None, :], w), axis=1)
        count = jnp.minimum(count, first_eos + 1)
        hit_eos = first_eos < w
    else:
        hit_eos = jnp.zeros((b,), bool)
    count = jnp.where(state.done, 0, count)

    def write(row_out, row_tokens, start):
        return jax.lax.dynamic_update_slice(row_out, row_tokens, (start,))

    out = jax.vmap(write)(state.out, tokens.astype(state.out.dtype), jnp.minimum(state.n_out, state.out.shape[1] - w))
    # Slots past ``count`` were written with drafts that were not accepted; they lie beyond n_out and are
    # overwritten by the next emission or cut off by n_out at the end.
    out = jnp.where(state.done[:, None], state.out, out)
    n_out = state.n_out + count
    done = state.done | (hit_eos & ~state.done) | (n_out >= state.limit)
    return out, jnp.minimum(n_out, state.limit), done


def counted(rs: RowSampling, tokens: Array, n: Array) -> RowSampling:
    """``rs`` with each row's first ``n`` emitted ``tokens`` added to its penalties' counts."""
    return rs if rs.penalties is None else dataclasses.replace(rs, penalties=rs.penalties.count(tokens, n))


def start_row(
    st: LoopState, slot, plen, first, done, max_tokens, stop_at_eos, rs: RowSampling, key, drafted, when, held
) -> LoopState:
    """``st`` with row ``slot`` starting a request whose prompt (``plen`` tokens) is in the caches:
    ``first`` is its first token (already out: it counts for the penalties and comes off ``max_tokens``),
    ``drafted`` the drafter's outputs after the prompt (anything with ``d_logits`` and ``d_feat`` [1, ...];
    None without a drafter). The row changes only where ``when`` (a traced bool: the prefill chunk reached the
    prompt's end) holds; otherwise it stays stopped (``done``) at length ``held``, the positions its
    caches hold so far: a stopped row's rounds still write the cache slots past its length, which must
    therefore lie past everything it holds (the next chunk recomputes them)."""

    def set_row(arr, value):
        if jax.dtypes.issubdtype(arr.dtype, jax.dtypes.prng_key):  # keys: chosen between as their data
            return arr.at[slot].set(
                jax.random.wrap_key_data(jnp.where(when, jax.random.key_data(value), jax.random.key_data(arr[slot])))
            )
        return arr.at[slot].set(jnp.where(when, jnp.asarray(value).astype(arr.dtype), arr[slot]))

    rs = counted(rs, first[None, None], jnp.ones((1,), jnp.int32))
    return dataclasses.replace(
        st,
        length=st.length.at[slot].set(jnp.where(when, plen, held)),
        pending=set_row(st.pending, first),
        n_out=set_row(st.n_out, 0),
        limit=set_row(st.limit, max_tokens - 1),  # the first token is already out
        done=st.done.at[slot].set(jnp.where(when, done, True)),
        d_logits=st.d_logits if drafted is None else set_row(st.d_logits, drafted.d_logits[0]),
        d_feat=st.d_feat if drafted is None else set_row(st.d_feat, drafted.d_feat[0]),
        sampling=jax.tree.map(lambda a, r: set_row(a, r[0]), st.sampling, rs),
        key=set_row(st.key, key),
        ignore_eos=set_row(st.ignore_eos, ~stop_at_eos),
    )
