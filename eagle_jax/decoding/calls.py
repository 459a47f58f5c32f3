"""What every ``generate`` call shares: prompt length buckets, the cache of compiled programs, a call's
checks and plan (``prepare``), its one-program run (``program``) and its result (``GenerationResult``)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.config import ConfigError, SpecConfig, check_pair
from eagle_jax.decoding.engine import Plan, run_rounds
from eagle_jax.decoding.penalties import RowPenalties
from eagle_jax.decoding.prefill import start
from eagle_jax.decoding.sampling import RowSampling, SamplingParams
from eagle_jax.modeling.drafter import Drafter
from eagle_jax.modeling.target import Target

# Powers of two and the midpoints between them: at most 1/3 of a prefill is padding.
PROMPT_BUCKETS = (
    16,
    32,
    48,
    64,
    96,
    128,
    192,
    256,
    384,
    512,
    768,
    1024,
    1536,
    2048,
    3072,
    4096,
    6144,
    8192,
    12288,
    16384,
    24576,
    32768,
)


@dataclass
class GenerationResult:
    """Tokens per row (prompt excluded), text when a tokenizer was given, and the run's statistics.

    ``accepted[b][r]``: drafts accepted by row b in round r (a round emits accepted + 1 tokens).
    ``acceptance_length``: tokens produced per target forward = mean over row-rounds of accepted + 1
    (the bonus token counted once; the prefill's first token is not a round and is not counted).
    ``position_acceptance[i]``: fraction of rounds whose draft i (0-based) was accepted.
    """

    tokens: list[list[int]]
    text: list[str] | None
    accepted: list[list[int]]
    acceptance_length: float
    position_acceptance: list[float]
    compile_s: float
    run_s: float
    rounds: int
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated / self.run_s if self.run_s > 0 else float("inf")


def bucket(n: int) -> int:
    for b in PROMPT_BUCKETS:
        if n <= b:
            return b
    raise ConfigError(f"prompt of {n} tokens is longer than the largest bucket {PROMPT_BUCKETS[-1]}")


class Programs:
    """Compiled programs, one per (models' graph, plan); reused across calls with the same shapes.

    Kept per pair of graphs: hashing a model's graph walks all of its nodes (~10 ms for a small
    model), so a call that runs several programs (``spec="auto"``) looks its pair up once (``pair``)."""

    def __init__(self) -> None:
        self._by_pair: dict[Any, dict[Any, Any]] = {}

    def pair(self, t_graph, d_graph) -> dict[Any, Any]:
        return self._by_pair.setdefault((t_graph, d_graph), {})

    def get(
        self,
        kind: str,
        t_graph,
        d_graph,
        plan: Plan,
        args: tuple,
        build,
        programs: dict | None = None,
        donate_argnums: tuple[int, ...] = (),
        states: tuple | None = None,
    ) -> tuple[Any, float]:
        """(the compiled program, seconds spent compiling it now); ``programs``: ``pair(t_graph, d_graph)``;
        ``donate_argnums``: arguments the program consumes (each ``kind`` always donates the same);
        ``states``: ``signature(args[:2])`` (the models' states), when the caller keeps it across lookups."""
        cache = self.pair(t_graph, d_graph) if programs is None else programs
        key = (kind, plan, signature(args[:2]) if states is None else states, signature(args[2:]))
        if key in cache:
            return cache[key], 0.0
        t0 = time.perf_counter()
        compiled = jax.jit(build, donate_argnums=donate_argnums).lower(*args).compile()
        cache[key] = compiled
        return compiled, time.perf_counter() - t0


PROGRAMS = Programs()


def signature(args: Any) -> tuple:
    """What a compiled program's key needs of its arguments: their tree and each leaf's shape, dtype and
    placement (~0.4 ms for a model's state: a ``spec="auto"`` call computes its models' once)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    return tree, tuple(
        (getattr(a, "shape", None), getattr(a, "dtype", None), getattr(a, "sharding", None)) for a in leaves
    )


def _ids(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, (int, np.integer)):
        return {int(value)}
    return {int(v) for v in value}


def eos_ids(target: Target, tokenizer=None, eos_token_id: int | Sequence[int] | None = None) -> tuple[int, ...]:
    """The ids that end a row: ``eos_token_id`` when given (``[]``: never stop early), else the model's
    own (generation_config.json, else config.json) together with the tokenizer's EOS."""
    if eos_token_id is not None:
        return tuple(sorted(_ids(eos_token_id)))
    ids = _ids(target.config.eos_token_id)
    if tokenizer is not None:
        ids |= _ids(getattr(tokenizer, "eos_token_id", None))
    return tuple(sorted(ids))


def prepare(
    target,
    drafter,
    prompts,
    max_new_tokens,
    sampling: SamplingParams,
    spec,
    eos_token_id,
    tokenizer,
    mesh=None,
    exact=False,
):
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if drafter is not None:
        check_pair(target.config, drafter.config)
    if isinstance(prompts, (str, np.ndarray)) or (prompts and isinstance(prompts[0], int)):
        raise ConfigError("prompts must be a list of prompts (token-id lists or strings), not a single prompt")
    if len(prompts) == 0:
        raise ConfigError("prompts is empty")
    ids: list[list[int]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ConfigError(f"prompt {i} is a string but no tokenizer was given")
            p = tokenizer.encode(p, add_special_tokens=False) if hasattr(tokenizer, "encode") else tokenizer(p)
        p = [int(t) for t in p]
        if not p:
            raise ConfigError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < target.config.vocab_size]
        if bad:
            raise ConfigError(
                f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {target.config.vocab_size})"
            )
        ids.append(p)
    longest = max(len(p) for p in ids)
    limit = target.config.max_position_embeddings
    if longest + max_new_tokens > limit:
        raise ConfigError(
            f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the target's "
            f"max_position_embeddings={limit}"
        )
    if isinstance(spec, str) and spec != "auto":
        raise ConfigError(f"spec must be a SpecConfig, a dict, 'auto' or None, got {spec!r}")
    spec_cfg = None if drafter is None else SpecConfig.parse(spec)  # "auto" is resolved before this
    plan = Plan.one_shot(
        batch=len(ids),
        prompt_len=bucket(max(len(p) for p in ids)),
        max_new=int(max_new_tokens),
        spec=spec_cfg,
        greedy=sampling.greedy,
        eos_ids=eos_ids(target, tokenizer, eos_token_id),
        mesh=mesh,
        exact=bool(exact),
    )
    prompt = np.zeros((plan.batch, bucket(longest)), np.int32)
    for i, p in enumerate(ids):
        prompt[i, : len(p)] = p
    lens = np.array([len(p) for p in ids], np.int32)
    rows = None
    if sampling.penalties.active:  # min_tokens holds back the call's stop tokens
        rows = RowPenalties.build(
            [dataclasses.replace(sampling, stop_ids=plan.eos_ids).penalties] * plan.batch, ids, target.config.vocab_size
        )
    return plan, jnp.asarray(prompt), jnp.asarray(lens), RowSampling.fill(sampling, plan.batch, rows)


def merged(t_graph, t_state, d_graph, d_state) -> tuple[Target, Drafter | None]:
    """The (target, drafter) modules from their graphs and states, inside a jitted function (no drafter graph: None)."""
    return nnx.merge(t_graph, t_state), None if d_graph is None else nnx.merge(d_graph, d_state)


def split(module):
    if module is None:
        return None, None
    return nnx.split(module)


def acceptance_summary(accepted: Sequence[int], k: int) -> tuple[float, list[float]]:
    """(acceptance length = mean of accepted + 1 over rounds, fraction of rounds accepting draft i for
    i < k) from drafts accepted per round; (0, zeros) for no rounds."""
    if not accepted:
        return 0.0, [0.0] * k
    acc = np.asarray(accepted)
    return float(acc.mean() + 1), [float(np.mean(acc > i)) for i in range(k)]


def result(state, plan: Plan, compile_s: float, run_s: float, tokenizer) -> GenerationResult:
    out, n_out, accepted, rounds = jax.device_get((state.out, state.n_out, state.accepted, state.rounds))
    tokens = [out[b, : n_out[b]].tolist() for b in range(plan.batch)]
    acc = [[int(a) for a in row[:rounds] if a >= 0] for row in accepted]
    k = 0 if plan.spec is None else plan.spec.max_emitted - 1
    al, pos = acceptance_summary([a for row in acc for a in row], k)
    text = None
    if tokenizer is not None:
        text = [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    return GenerationResult(tokens, text, acc, al, pos, compile_s, run_s, int(rounds), {"spec": plan.spec})


def split_pair(target: Target, drafter: Drafter | None, mesh) -> tuple[Any, Any, Any, Any]:
    """(target graph, target state, drafter graph, drafter state): the states placed on ``mesh`` where one is
    given (tensor parallel: heads / MLP / vocabulary over its "model" axis by the one rule table; a compiled
    program follows the placement of its inputs). The caller's modules are untouched."""
    t_graph, t_state = split(target)
    d_graph, d_state = split(drafter)
    if mesh is not None:
        from eagle_jax.sharding import shard_tree

        t_state = shard_tree(t_state, mesh)
        d_state = None if d_state is None else shard_tree(d_state, mesh)
    return t_graph, t_state, d_graph, d_state


def program(models: tuple[Any, Any, Any, Any], plan: Plan, prompt, lens, rs, seed: int):
    """(generate's compiled program for ``plan``, its arguments, compile seconds). ``models``: ``split_pair``'s.
    The program takes ``(t_state, d_state, prompt, lens,
    rs, key, limit)`` and returns the loop state after the prefill and at most ``limit`` rounds."""
    t_graph, t_state, d_graph, d_state = models

    def run(t_state, d_state, prompt, lens, rs, key, limit):
        tgt, drf = merged(t_graph, t_state, d_graph, d_state)
        st = start(tgt, drf, plan, prompt, lens, rs, key, plan.max_rounds)
        return run_rounds(tgt, drf, plan, st, limit)

    args = (t_state, d_state, prompt, lens, rs, jax.random.key(seed), jnp.int32(plan.max_rounds))
    compiled, compile_s = PROGRAMS.get("generate", t_graph, d_graph, plan, args, run)
    return compiled, args, compile_s


def run_whole(models: tuple[Any, Any, Any, Any], plan: Plan, prompt, lens, rs, seed: int) -> tuple[Any, float, float]:
    """A call run as one program (``program``), the prefill and every round in one execution: (final loop state,
    compile seconds, run seconds): a fixed ``spec``'s ``generate``."""
    compiled, args, compile_s = program(models, plan, prompt, lens, rs, seed)
    t0 = time.perf_counter()
    state = compiled(*args)
    jax.block_until_ready(state.out)
    return state, compile_s, time.perf_counter() - t0
