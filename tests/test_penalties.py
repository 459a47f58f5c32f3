"""Presence / frequency / repetition penalties, logit_bias, min_tokens and min_p on the target's
verification logits (decoding/penalties.py): greedy speculation of every kind equals greedy plain
decoding under the same processors, and both equal an independent step-by-step reference. The sampling
law under them is checked in test_engine.py (SAMPLING_CASES "*-penalties")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_models import markov_pair
from flax import nnx
from penalty_reference import processed

import eagle_jax
from eagle_jax import SpecConfig
from eagle_jax.config import ConfigError
from eagle_jax.decoding import chooser

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], list(range(20))]
EOS = 7
MAX_NEW = 24
PEN = dict(
    presence_penalty=0.4, frequency_penalty=0.6, repetition_penalty=1.5, logit_bias={3: 2.0, 9: -5.0}, min_tokens=6
)


@pytest.fixture(scope="module")
def pair():
    return markov_pair()


def reference(target, prompt: list[int], pen: dict) -> list[int]:
    """Greedy decoding one token at a time: a full forward over the sequence, the last logits processed."""
    graph, state = nnx.split(target)
    width = len(prompt) + MAX_NEW + 1

    @jax.jit
    def last_logits(state, ids, n):
        logits, _ = nnx.merge(graph, state)(ids)
        return logits[0, n - 1]

    out: list[int] = []
    while len(out) < MAX_NEW:
        seq = prompt + out
        ids = np.zeros((1, width), np.int32)
        ids[0, : len(seq)] = seq
        x = np.asarray(last_logits(state, jnp.asarray(ids), len(seq)))
        tok = int(np.argmax(processed(x, prompt, out, stop_ids=(EOS,), **pen)))
        out.append(tok)
        if tok == EOS:
            break
    return out


SPECS = {
    "plain": (False, None),
    "chain": (True, SpecConfig(num_speculative_tokens=3)),
    "tree": (True, SpecConfig(method="tree", tree_top_k=3, tree_depth=3, tree_total_tokens=8)),
    "auto": (True, None),
}


def test_greedy_speculation_equals_plain_under_penalties(pair):
    target, drafter = pair
    ref = [reference(target, p, PEN) for p in PROMPTS]
    unpenalised = eagle_jax.generate(target, None, PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=[EOS]).tokens
    assert ref != unpenalised  # the processors change the output
    assert all(len(r) >= PEN["min_tokens"] for r in ref) and EOS not in sum((r[: PEN["min_tokens"]] for r in ref), [])
    chooser.reset()
    for name, (with_drafter, spec) in SPECS.items():
        res = eagle_jax.generate(
            target,
            drafter if with_drafter else None,
            PROMPTS,
            max_new_tokens=MAX_NEW,
            spec=spec,
            eos_token_id=[EOS],
            **PEN,
        )
        assert res.tokens == ref, name
        if name in ("chain", "tree"):
            assert max(a for row in res.accepted for a in row) >= 2, name  # drafts were accepted under penalties


def test_bad_processor_values_are_refused(pair):
    target, drafter = pair
    for kw, match in [
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_p=1.5), "min_p"),
        (dict(logit_bias={99: 1.0}), "outside the vocabulary"),
        (dict(logit_bias={1: 150.0}), "logit_bias values"),
        (dict(min_tokens=-1), "min_tokens"),
    ]:
        with pytest.raises(ConfigError, match=match):
            eagle_jax.generate(target, drafter, PROMPTS, max_new_tokens=4, spec=SPECS["chain"][1], **kw)


def test_served_requests_equal_generate_under_penalties(pair):
    """Through the slot engine (requests with and without processors sharing steps): each request's
    tokens are generate's plain decoding under its own processors."""
    from eagle_jax.decoding.sampling import SamplingParams
    from eagle_jax.serving import Request, Scheduler, SlotEngine, SpecSchedule

    target, drafter = pair
    schedule = SpecSchedule.parse("1:3")
    engine = SlotEngine(target, drafter, slots=2, max_len=96, specs=schedule.specs, rounds_per_step=3, eos_ids=(EOS,))
    sched = Scheduler(engine, schedule).start()
    kinds = [PEN, {}, dict(PEN, min_p=0.2, logit_bias={}), dict(repetition_penalty=0.7, min_tokens=30)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))]

    def request(prompt, pen):
        return Request(tuple(prompt), MAX_NEW, SamplingParams(**pen))

    try:
        handles = [sched.submit(request(p, pen)) for p, pen in zip(prompts, kinds)]
        for h in handles:
            h.wait(300)
    finally:
        sched.stop()
    for p, pen, h in zip(prompts, kinds, handles):
        assert (
            h.tokens
            == eagle_jax.generate(target, None, [p], max_new_tokens=MAX_NEW, eos_token_id=[EOS], **pen).tokens[0]
        )
    assert len(handles[3].tokens) == MAX_NEW  # min_tokens beyond the limit: no EOS at all
    assert sum(a for h in handles for a in h.accepted) > 0
