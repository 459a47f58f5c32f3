"""The slot engine's device programs, as functions to jit: a prefill ``chunk`` (and the ``row`` read it
starts from), a cache row ``copy`` and a ``step``. Each takes the target's and the drafter's states, the
engine's ``LoopState`` (donated) and its own arguments, and returns the new state first; ``merge``
rebuilds the models from their states. ``slots.SlotEngine`` builds the arguments, compiles the programs
(``program_set``) and runs them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from eagle_jax.decoding.engine import Plan, run_rounds
from eagle_jax.decoding.prefill import prefill_chunk
from eagle_jax.decoding.sampling import split_rows
from eagle_jax.decoding.state import LoopState, start_row

# LoopState fields with one entry per slot (the caches are shared whole; ``rounds`` is a scalar).
PER_ROW = tuple(f.name for f in dataclasses.fields(LoopState) if f.name not in ("t_cache", "d_cache", "rounds"))
Merge = Callable  # (target state, drafter state) -> (Target, Drafter | None)


def _done(first, max_tokens, stop_at_eos, eos: tuple[int, ...]):
    """Whether a request ends at its first token: a one-token limit, or EOS where EOS stops it."""
    return (max_tokens <= 1) | (stop_at_eos & jnp.isin(first, jnp.asarray(eos or (-1,), jnp.int32)))


def row_program():
    """One slot's rows of the target's and the drafter's caches, read out for a prefill ``chunk``.

    A program of its own: read inside the chunk program, XLA fuses the row's reads into the chunk's
    attention, which then overlaps the in-place write-back of the row, and it copies every cache whole
    to keep the two apart: a chunk would then cost a copy of every slot's cache, not one row's read
    (BENCHMARKS.md, "Prefix caching and chunked prefill (bench.prefill)")."""

    def read(st: LoopState, slot):
        def row(a):
            return jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=0)

        return jax.tree.map(row, st.t_cache), None if st.d_cache is None else jax.tree.map(row, st.d_cache)

    return read


def chunk_program(merge: Merge, plan: Plan, c: int):
    """Computes prompt positions ``start..start+c-1`` into ``slot`` (``prefill_chunk``) from the slot's
    cache rows ``t_row`` / ``d_row`` (``row_program``); the request starts where the chunk reaches the
    prompt's end, and otherwise its row stays stopped at ``start + c``."""

    def chunk(t_state, d_state, st: LoopState, t_row, d_row, slot, ids, start, plen, rs, key, max_tokens, stop_at_eos):
        tgt, drf = merge(t_state, d_state)
        keys = split_rows(key[None], 2)

        def put(a, r):  # only the chunk's positions back into the slot's row (every cache is [rows, heads, slots, dim])
            part = jax.lax.dynamic_slice_in_dim(r, start, c, axis=2).astype(a.dtype)
            return jax.lax.dynamic_update_slice(a, part, (slot, 0, start, 0))

        pre = prefill_chunk(tgt, drf, plan, ids, start[None], plen[None], t_row, d_row, rs, keys[:, 1])
        st = dataclasses.replace(
            st,
            t_cache=jax.tree.map(put, st.t_cache, pre.t_cache),
            d_cache=None if drf is None else jax.tree.map(put, st.d_cache, pre.d_cache),
        )
        first = pre.first[0]
        done = _done(first, max_tokens, stop_at_eos, plan.eos_ids)
        new = start_row(
            st,
            slot,
            plen,
            first,
            done,
            max_tokens,
            stop_at_eos,
            rs,
            keys[0, 0],
            None if drf is None else pre,
            when=plen <= start + c,
            held=start + c,
        )
        return new, first, done

    return chunk


def copy_program():
    """Copies one cache row into another, whole (``SlotEngine.copy_row``: the rows past the slots keep
    prefixes for reuse); a destination slot stops at length ``held``."""

    def copy(st: LoopState, src, dst, held):
        def row(a):
            return jax.lax.dynamic_update_slice_in_dim(a, jax.lax.dynamic_slice_in_dim(a, src, 1, axis=0), dst, axis=0)

        # A destination past the slots has no per-slot state: those updates are dropped.
        return dataclasses.replace(
            st,
            t_cache=jax.tree.map(row, st.t_cache),
            d_cache=jax.tree.map(row, st.d_cache),
            length=st.length.at[dst].set(held, mode="drop"),
            done=st.done.at[dst].set(True, mode="drop"),
        )

    return copy


def step_program(merge: Merge, plan: Plan):
    """``rounds`` rounds (at most ``plan.max_rounds``; data, so any count runs the same program) over the
    leading ``plan.batch`` slots; slots in ``cancel`` stop first."""
    rows = plan.batch

    def step(t_state, d_state, st: LoopState, cancel, rounds):
        tgt, drf = merge(t_state, d_state)
        # A step's outputs start empty; what the last step emitted comes off each row's budget.
        st = dataclasses.replace(
            st,
            limit=st.limit - st.n_out,
            n_out=jnp.zeros_like(st.n_out),
            done=st.done | cancel,
            rounds=jnp.int32(0),
            accepted=jnp.full_like(st.accepted, -1),
            probe=None if st.probe is None else jnp.zeros_like(st.probe),
        )
        # The rounds see the leading ``rows`` rows of every per-row array and the whole caches, which
        # they update in place (rows beyond are free slots: neither read nor written).
        sub = dataclasses.replace(st, **{f: jax.tree.map(lambda a: a[:rows], getattr(st, f)) for f in PER_ROW})
        sub = run_rounds(tgt, drf, plan, sub, rounds)
        return dataclasses.replace(
            sub, **{f: jax.tree.map(lambda a, b: a.at[:rows].set(b), getattr(st, f), getattr(sub, f)) for f in PER_ROW}
        )

    return step
