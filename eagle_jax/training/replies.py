"""Replies to many prompts at once, for data generation: the serving engine's continuous batching.

A static batch runs every row until its longest reply ends, so rows whose replies end early compute nothing
useful for the rest of the batch (half of the Magpie replies end well before ``max_new_tokens``). Here the
prompts queue on a ``serving.Scheduler`` over ``slots`` cache rows, and a row whose reply ends takes the next
prompt at the following step. Greedy replies are the target's own greedy decoding token for token, as the
server's are; sampled ones keep its distribution, each prompt's draws fixed by its own seed (not by the row
it lands on or what shares the batch), so a resumed run writes what an uninterrupted one would.

The engine is built once per writer and grows (a new engine, compiled again) only when a prompt plus its
reply needs a longer cache than it has; its length is rounded up to ``CACHE_GRANULE``.
"""

from __future__ import annotations

from typing import Callable, Sequence

from eagle_jax.config import ConfigError
from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.modeling.drafter import Drafter
from eagle_jax.modeling.target import Target

CACHE_GRANULE = 256  # cache lengths are multiples of this (attention reads the cache in blocks of this size)


class ReplyWriter:
    """Generates replies for lists of prompt token ids over ``slots`` rows with continuous batching; with a drafter,
    speculatively (the server's default chooser). ``eos_ids``: the tokens that end every reply (the target's
    EOS); ``write`` adds its own stops. Use as a context manager, or ``close`` it: the engine runs on a thread."""

    def __init__(self, target: Target, drafter: Drafter | None, *, slots: int, eos_ids: Sequence[int]):
        if slots < 1:
            raise ConfigError(f"the reply writer needs at least 1 slot (batch size), got {slots}")
        self.target, self.drafter, self.slots, self.eos_ids = target, drafter, slots, tuple(eos_ids)
        self._scheduler = None

    def _scheduler_for(self, need: int):
        """A running scheduler whose engine holds ``need`` tokens per row (a longer one replaces a shorter one)."""
        from eagle_jax.serving.scheduler import Scheduler
        from eagle_jax.serving.server import parse_spec
        from eagle_jax.serving.slots import SlotEngine

        limit = self.target.config.max_position_embeddings
        if need > limit:
            raise ConfigError(f"a prompt and its reply need {need} positions, past the target's context of {limit}")
        if self._scheduler is not None and self._scheduler.engine.max_len >= need:
            return self._scheduler
        self.close()
        schedule = parse_spec(None, self.drafter is not None)
        engine = SlotEngine(
            self.target,
            self.drafter,
            slots=self.slots,
            max_len=min(limit, -(-need // CACHE_GRANULE) * CACHE_GRANULE),
            specs=schedule.specs,
            eos_ids=self.eos_ids,
        )
        self._scheduler = Scheduler(engine, schedule, max_queue=1 << 30, step_ms=0).start()
        return self._scheduler

    def write(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_ids: Sequence[int] = (),
        on_reply: Callable[[], None] | None = None,
    ) -> list[list[int]]:
        """Each prompt's reply tokens (ending with the stop token that ended it, if one did), in prompt order.
        Prompt i draws with seed ``seed + i``. ``on_reply()`` is called as each reply is collected (progress)."""
        from eagle_jax.serving.scheduler import Request

        if not prompts:
            return []
        sampling = SamplingParams(temperature=temperature, top_p=top_p)
        scheduler = self._scheduler_for(max(map(len, prompts)) + max_new_tokens)
        handles = []
        try:
            for i, p in enumerate(prompts):
                request = Request(tuple(p), max_new_tokens, sampling, seed=seed + i, stop_token_ids=tuple(stop_ids))
                handles.append(scheduler.submit(request))
            replies = []
            for h in handles:
                h.wait()
                if h.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"a reply failed ({h.finish_reason}): {h.error}")
                replies.append(list(h.tokens))
                if on_reply is not None:
                    on_reply()
        except BaseException:
            for h in handles:  # a bad prompt or an interrupt: nothing of this call keeps running
                h.cancel()
            raise
        return replies

    def close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.stop()
            self._scheduler = None

    def __enter__(self) -> "ReplyWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
