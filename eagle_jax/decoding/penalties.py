"""Logits processors that depend on what a row has generated: presence, frequency and repetition
penalties, ``logit_bias`` and ``min_tokens`` (as vLLM and the OpenAI API define them).

They act on the target's logits wherever the target picks or verifies a token: the prefill's first
token, a plain step, every position of a chain's verification, every node of a tree. A
verified position counts, on top of the row's generated tokens, the drafts on its path (a chain's
drafts before it, a tree node's ancestors): those are exactly the tokens the row will have generated
if the position's own token is accepted, so each position sees the logits plain decoding would have
processed there. Greedy speculation therefore equals greedy plain decoding under the same penalties,
and speculative sampling keeps the processed distribution (its rules only need the verified p). The
drafter proposes from its own, unprocessed logits: penalties cost acceptance, never exactness.

Order, as vLLM's: ``min_tokens`` (the row's stop tokens held back), ``logit_bias``, repetition,
frequency and presence penalties; temperature, ``min_p``, top-k and top-p follow in
``sampling.target_probs``. Counts are of generated tokens (the prompt's are not, as in vLLM and
OpenAI); the repetition penalty also covers the prompt's tokens (as HF and vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.config import ConfigError

Array = jax.Array
MAX_LOGIT_BIAS = 300  # entries of a request's logit_bias (OpenAI's bound); a row's table is this wide
MAX_STOP_IDS = 16  # a request's stop tokens (EOS and stop_token_ids) that min_tokens holds back


@dataclass(frozen=True)
class Penalties:
    """One request's processors; the defaults change nothing."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()  # what min_tokens holds back: the row's EOS and stop_token_ids

    def __post_init__(self) -> None:
        for name, v in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not -2.0 <= v <= 2.0:
                raise ConfigError(f"{name} must be in [-2, 2], got {v}")
        if not self.repetition > 0:
            raise ConfigError(f"repetition_penalty must be > 0, got {self.repetition}")
        if self.min_tokens < 0:
            raise ConfigError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ConfigError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are accepted")
        bad = [v for _, v in self.logit_bias if not -100.0 <= v <= 100.0]
        if bad:
            raise ConfigError(f"logit_bias values must be in [-100, 100], got {bad[:3]}")
        if len(self.stop_ids) > MAX_STOP_IDS and self.min_tokens:
            raise ConfigError(
                f"min_tokens holds back at most {MAX_STOP_IDS} stop tokens (EOS and stop_token_ids), got "
                f"{len(self.stop_ids)}"
            )

    @property
    def active(self) -> bool:
        return (self.presence, self.frequency, self.repetition, self.logit_bias, self.min_tokens) != (
            0.0,
            0.0,
            1.0,
            (),
            0,
        )

    def check_vocab(self, vocab: int) -> None:
        bad = [t for t, _ in self.logit_bias if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab})")


@jax.tree_util.register_dataclass
@dataclass
class RowPenalties:
    """Per-row processors [B] and the counts they read, carried with the sampling parameters
    (``RowSampling.penalties``) and counted on by every round (``engine.one_round``)."""

    presence: Array  # [B] float32
    frequency: Array  # [B] float32
    repetition: Array  # [B] float32, 1 = off
    bias_ids: Array  # [B, MAX_LOGIT_BIAS] int32, -1 = unused
    bias: Array  # [B, MAX_LOGIT_BIAS] float32
    min_tokens: Array  # [B] int32
    stop_ids: Array  # [B, MAX_STOP_IDS] int32, -1 = unused
    counts: Array  # [B, V] int32: tokens the row has generated
    prompt: Array  # [B, V] bool: tokens of the row's prompt (the repetition penalty's)

    @classmethod
    def build(cls, penalties: list[Penalties], prompts: list[list[int]], vocab: int) -> "RowPenalties":
        b = len(penalties)
        bias_ids = np.full((b, MAX_LOGIT_BIAS), -1, np.int32)
        bias = np.zeros((b, MAX_LOGIT_BIAS), np.float32)
        stop_ids = np.full((b, MAX_STOP_IDS), -1, np.int32)
        seen = np.zeros((b, vocab), bool)
        for i, (p, prompt) in enumerate(zip(penalties, prompts)):
            p.check_vocab(vocab)
            for j, (t, v) in enumerate(p.logit_bias):
                bias_ids[i, j], bias[i, j] = t, v
            stop_ids[i, : len(p.stop_ids[:MAX_STOP_IDS])] = p.stop_ids[:MAX_STOP_IDS]
            seen[i, np.asarray(prompt, np.int64)] = True
        # Host arrays: a program's arguments, moved with its call (eager jnp ops here cost ~2 ms a prefill chunk).
        col = lambda name, dtype: np.asarray([getattr(p, name) for p in penalties], dtype)  # noqa: E731
        return cls(
            col("presence", np.float32),
            col("frequency", np.float32),
            col("repetition", np.float32),
            bias_ids,
            bias,
            col("min_tokens", np.int32),
            stop_ids,
            np.zeros((b, vocab), np.int32),
            seen,
        )

    def count(self, tokens: Array, n: Array) -> "RowPenalties":
        """Adds each row's first ``n`` of ``tokens`` [B, W] (what it emitted) to its counts."""
        valid = jnp.arange(tokens.shape[1])[None, :] < n[:, None]
        rows = jnp.broadcast_to(jnp.arange(tokens.shape[0])[:, None], tokens.shape)
        counts = self.counts.at[rows, jnp.where(valid, tokens, 0)].add(valid.astype(jnp.int32))
        return RowPenalties(**{**self.__dict__, "counts": counts})


def chain_paths(width: int) -> Array:
    """[W, W] for verified positions 0..W-1 of a chain (position 0 = the pending token): position i
    counts block tokens 1..i, the drafts before it."""
    j = jnp.arange(width)
    return (j[None, :] >= 1) & (j[None, :] <= j[:, None])


def apply(logits: Array, pen: RowPenalties, block: Array | None = None, paths: Array | None = None) -> Array:
    """Processed logits [B, P, V] (or [B, V]) for positions whose path adds ``block`` [B, P] tokens
    where ``paths`` [P, P] or [B, P, P] is true (None: no tokens beyond the row's counts)."""
    flat = logits.ndim == 2
    x = logits[:, None, :] if flat else logits

    def process(x):
        b, p, v = x.shape
        x = x.astype(jnp.float32)
        counts = pen.counts[:, None, :]
        extra = jnp.zeros((b, p), jnp.int32)
        if block is not None:
            on_path = jnp.broadcast_to(paths, (b, p, p)).astype(jnp.float32)
            counts = counts + jnp.einsum("bij,bjv->biv", on_path, jax.nn.one_hot(block, v, dtype=jnp.float32)).astype(
                jnp.int32
            )
            extra = jnp.sum(on_path, axis=-1).astype(jnp.int32)
        generated = jnp.sum(pen.counts, axis=-1)[:, None] + extra  # [B, P] tokens out before each position's
        stops = pen.stop_ids
        is_stop = jnp.zeros((b, v), bool).at[jnp.arange(b)[:, None], jnp.where(stops >= 0, stops, 0)].max(stops >= 0)
        x = jnp.where(is_stop[:, None, :] & (generated < pen.min_tokens[:, None])[:, :, None], -jnp.inf, x)
        bias = (
            jnp.zeros((b, v), jnp.float32)
            .at[jnp.arange(b)[:, None], jnp.where(pen.bias_ids >= 0, pen.bias_ids, 0)]
            .add(jnp.where(pen.bias_ids >= 0, pen.bias, 0.0))
        )
        x = x + bias[:, None, :]
        r = pen.repetition[:, None, None]
        x = jnp.where(pen.prompt[:, None, :] | (counts > 0), jnp.where(x > 0, x / r, x * r), x)
        return x - pen.frequency[:, None, None] * counts - pen.presence[:, None, None] * (counts > 0)

    active = (
        (pen.presence != 0)
        | (pen.frequency != 0)
        | (pen.repetition != 1)
        | (pen.min_tokens > 0)
        | jnp.any(pen.bias_ids >= 0, axis=1)
    )
    # Rows without processors (and programs whose rows have none) skip the work: a runtime branch.
    x = jax.lax.cond(jnp.any(active), process, lambda x: x.astype(jnp.float32), x)
    return x[:, 0] if flat else x
