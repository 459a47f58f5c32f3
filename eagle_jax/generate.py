"""``eagle_jax.generate``: the Python entry point of speculative decoding."""

from __future__ import annotations

from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.config import ConfigError, SpecConfig
from eagle_jax.decoding import calls
from eagle_jax.decoding.auto_run import AutoRun
from eagle_jax.decoding.calls import GenerationResult
from eagle_jax.decoding.engine import run_rounds
from eagle_jax.decoding.prefill import start
from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.modeling.drafter import Drafter
from eagle_jax.modeling.target import Target


def _wants_auto(drafter: Drafter | None, spec) -> bool:
    """A drafter and no spec (or "auto"): the depth is chosen chunk by chunk (``AutoRun``)."""
    return drafter is not None and (spec is None or (isinstance(spec, str) and spec == "auto"))


def generate(
    target: Target,
    drafter: Drafter | None,
    prompts: Sequence[Sequence[int] | str],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    logit_bias: dict[int, float] | None = None,
    min_tokens: int = 0,
    spec: SpecConfig | dict | str | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    seed: int = 0,
    tokenizer=None,
    mesh=None,
    exact: bool = False,
) -> GenerationResult:
    """Generates up to ``max_new_tokens`` per prompt with speculative decoding (``drafter=None``: plain).

    One XLA program per call: target prefill with aux capture, drafter prefill, then a while_loop of
    rounds with no host round trip. Sampling keeps the target's distribution (temperature / top_k /
    top_p). Prompts are padded to length buckets so new lengths reuse compiled programs. ``mesh``: run
    tensor-parallel over the mesh's ``model`` axis.

    Greedy output equals the target's own greedy decoding token for token in float32. In bfloat16 it
    does except at near-ties (top-2 logits within bf16 rounding, as in every engine): a position's
    bf16 logits depend slightly on how many positions and rows one matmul covers, so verification of
    K+1 positions (and plain decoding at another batch size) can resolve a tie differently.
    ``exact=True`` computes the target in float32 from its stored weights, plain and speculative
    alike: the output is then the same for every batch size, drafter and speculation setting (cost:
    fp32 activations and caches; BENCHMARKS.md, "Exactness in bfloat16, and the cost of exact mode").

    ``spec``: a SpecConfig or dict, or "auto" (the default, None, with a drafter): the call runs in
    chunks of a few rounds, each at the depth (no drafts or a chain of ``chooser.DEPTHS`` drafts) with the
    most expected tokens per second from the round costs measured so far for this pair, batch size and
    sampling mode and the acceptance observed so far on its traffic, this call's included
    (``decoding/chooser.py``). ``result.stats["chunks"]`` lists the (depth, rounds) that ran (depth 0:
    rounds without drafts).

    ``eos_token_id``: None = the model's own (generation_config.json / config.json) and the
    tokenizer's; an id or a list; ``[]`` = never stop before ``max_new_tokens``.

    ``min_p``, ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``, ``logit_bias``
    ({token id: bias}) and ``min_tokens`` as vLLM defines them (``decoding/penalties.py``): they act
    on the target's logits at every verified position, so the output is plain decoding's under the
    same processors (greedy) or the processed distribution (sampling).
    """
    sampling = SamplingParams(
        temperature,
        top_k,
        top_p,
        min_p,
        presence_penalty,
        frequency_penalty,
        repetition_penalty,
        logit_bias or (),
        min_tokens,
    )
    kw = dict(sampling=sampling, eos_token_id=eos_token_id, seed=seed, tokenizer=tokenizer, mesh=mesh, exact=exact)
    if _wants_auto(drafter, spec):
        return AutoRun(target, drafter, prompts, max_new_tokens, kw).result(tokenizer)
    plan, prompt, lens, rs = calls.prepare(
        target, drafter, prompts, max_new_tokens, sampling, spec, eos_token_id, tokenizer, mesh, exact
    )
    state, compile_s, run_s = calls.run_whole(calls.split_pair(target, drafter, mesh), plan, prompt, lens, rs, seed)
    return calls.result(state, plan, compile_s, run_s, tokenizer)


def _new_tokens(out: np.ndarray, n_out: np.ndarray, sent: list[int]) -> tuple[list[list[int]], list[int]]:
    """Each row's tokens past the ``sent`` already yielded, and the new counts."""
    return [out[b, sent[b] : n_out[b]].tolist() for b in range(len(sent))], [int(n) for n in n_out]


def generate_stream(
    target: Target,
    drafter: Drafter | None,
    prompts: Sequence[Sequence[int] | str],
    *,
    max_new_tokens: int,
    rounds_per_chunk: int = 8,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    logit_bias: dict[int, float] | None = None,
    min_tokens: int = 0,
    spec: SpecConfig | dict | str | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    seed: int = 0,
    tokenizer=None,
    exact: bool = False,
) -> Iterator[list[list[int]]]:
    """The same loop run in chunks of ``rounds_per_chunk`` rounds; yields each row's new tokens per chunk.
    ``spec`` as in ``generate`` ("auto" streams each of its chunks of rounds, none longer than ``rounds_per_chunk``
    once a depth is chosen: its choices run in the chunks a stream can wait for)."""
    if rounds_per_chunk < 1:
        raise ConfigError(f"rounds_per_chunk must be >= 1, got {rounds_per_chunk}")
    sampling = SamplingParams(
        temperature,
        top_k,
        top_p,
        min_p,
        presence_penalty,
        frequency_penalty,
        repetition_penalty,
        logit_bias or (),
        min_tokens,
    )
    if _wants_auto(drafter, spec):  # streams AutoRun's chunks
        kw = dict(sampling=sampling, eos_token_id=eos_token_id, seed=seed, tokenizer=tokenizer, mesh=None, exact=exact)
        sent = [0] * len(prompts)
        for st in AutoRun(target, drafter, prompts, max_new_tokens, kw, most_rounds=rounds_per_chunk):
            new, sent = _new_tokens(*jax.device_get((st.out, st.n_out)), sent)
            if any(new):
                yield new
        return
    plan, prompt, lens, rs = calls.prepare(
        target, drafter, prompts, max_new_tokens, sampling, spec, eos_token_id, tokenizer, None, exact
    )
    t_graph, t_state, d_graph, d_state = calls.split_pair(target, drafter, None)

    def begin(t_state, d_state, prompt, lens, rs, key):
        return start(*calls.merged(t_graph, t_state, d_graph, d_state), plan, prompt, lens, rs, key, plan.max_rounds)

    def chunk(t_state, d_state, st, limit):
        return run_rounds(*calls.merged(t_graph, t_state, d_graph, d_state), plan, st, limit)

    args = (t_state, d_state, prompt, lens, rs, jax.random.key(seed))
    start_c, _ = calls.PROGRAMS.get("stream_start", t_graph, d_graph, plan, args, begin)
    st = start_c(*args)
    chunk_c, _ = calls.PROGRAMS.get("stream_chunk", t_graph, d_graph, plan, (t_state, d_state, st, jnp.int32(0)), chunk)
    sent = [0] * plan.batch
    while True:
        out, n_out, done, rounds = jax.device_get((st.out, st.n_out, st.done, st.rounds))
        new, sent = _new_tokens(out, n_out, sent)
        if any(new):
            yield new
        if done.all() or rounds >= plan.max_rounds:
            return
        st = chunk_c(t_state, d_state, st, jnp.int32(rounds + rounds_per_chunk))
