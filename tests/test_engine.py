"""Tests of the speculative decoding engine: greedy equality with plain decoding, no leakage
between rows, cache invariants after every round, losslessness of sampling, argument errors, streaming.

Compile time dominates (every distinct plan is a new XLA program), so the models are tiny, results are
memoised per module and most tests share one batch of prompts, one bucket and one max_new_tokens. The
greedy runs of the hand-built Markov pair (engine_models.py) all set one EOS id, picked from the plain
output so that some rows stop mid-way and others run to max_new_tokens: every run checks both.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import penalty_reference
import pytest
from engine_models import drafter_config, markov_drafter, markov_target, random_pair, target_config
from flax import nnx

import eagle_jax
from eagle_jax import ConfigError, Drafter, SpecConfig
from eagle_jax.config import aux_layer_ids_for
from eagle_jax.decoding import auto_run, calls, chooser, engine
from eagle_jax.decoding.engine import one_round
from eagle_jax.decoding.prefill import start
from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.modeling import layers

MAX_NEW = 24
# Ragged batch: lengths 5, 12 (bucket 16) and 17, 30 (bucket 32): the batch is padded to 32.
_rng = np.random.default_rng(1234)
PROMPTS = [_rng.integers(0, 32, size=n).tolist() for n in (5, 12, 17, 30)]

CHAIN3 = SpecConfig(num_speculative_tokens=3)
TREE_A = SpecConfig(method="tree", tree_top_k=3, tree_depth=3, tree_total_tokens=8)
TREE_B = SpecConfig(method="tree", tree_top_k=2, tree_depth=4, tree_total_tokens=9)
SPECS = {
    "chain1": SpecConfig(num_speculative_tokens=1),
    "chain3": CHAIN3,
    "chain5": SpecConfig(num_speculative_tokens=5),
    "tree3x3x8": TREE_A,
    "tree2x4x9": TREE_B,
}


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def markov():
    """(target, drafter, succ, draft_succ): the bigram-like pair whose drafts are often accepted."""
    target, succ = markov_target(vocab=32, hidden=64, seed=0, eps=0.1)
    drafter, draft_succ = markov_drafter(target, succ, seed=0, disagree=0.25)
    return target, drafter, succ, draft_succ


@pytest.fixture(scope="module")
def small_vocab_drafter(markov):
    """The same construction with a draft vocabulary of 24 of the 32 target ids (d2t non-trivial)."""
    target, _, succ, _ = markov
    subset = sorted(np.random.default_rng(5).choice(32, size=24, replace=False).tolist())
    drafter, _ = markov_drafter(target, succ, seed=0, disagree=0.25, draft_vocab=subset)
    assert drafter.config.draft_vocab_size == 24 and np.any(np.asarray(drafter.d2t[...]) != 0)
    return drafter, subset


@pytest.fixture(scope="module")
def plain(markov):
    """Plain greedy decoding (drafter=None) of PROMPTS, no EOS: the reference."""
    return eagle_jax.generate(markov[0], None, PROMPTS, max_new_tokens=MAX_NEW)


def _pick_eos(tokens: list[list[int]]) -> int:
    """An id first occurring mid-way (index 10..MAX_NEW-4) in some row and absent from two others."""
    for tok in range(32):
        firsts = [row.index(tok) if tok in row else None for row in tokens]
        if any(f is not None and 10 <= f < MAX_NEW - 3 for f in firsts) and firsts.count(None) >= 2:
            return tok
    raise AssertionError("no suitable eos id in the plain output")


@pytest.fixture(scope="module")
def eos(plain):
    return _pick_eos(plain.tokens)


@pytest.fixture(scope="module")
def expected(plain, eos):
    """Plain greedy output cut right after the first EOS: what every greedy run with eos must give."""
    out = [row[: row.index(eos) + 1] if eos in row else row for row in plain.tokens]
    assert any(len(e) < MAX_NEW for e in out) and any(len(e) == MAX_NEW for e in out)
    return out


@pytest.fixture(scope="module")
def runs(markov, eos):
    """Memoised greedy ``generate`` calls on the Markov pair, all with the same EOS id (one program each)."""
    memo = {}

    def run(name, drafter, spec, prompts=PROMPTS):
        if name not in memo:
            memo[name] = eagle_jax.generate(
                markov[0], drafter, prompts, max_new_tokens=MAX_NEW, spec=spec, eos_token_id=eos
            )
        return memo[name]

    return run


# --------------------------------------------------------------------------------- 1. greedy equality


def test_plain_decoding_is_greedy_over_full_forwards(markov, plain):
    """The reference itself: plain cached decoding equals argmax over uncached full-sequence forwards."""
    target = markov[0]
    graph, state = nnx.split(target)
    width = 64
    full_logits = jax.jit(lambda s, ids: nnx.merge(graph, s)(ids)[0])
    seqs = [list(p) for p in PROMPTS]
    for _ in range(MAX_NEW):
        ids = np.zeros((len(seqs), width), np.int32)
        for b, s in enumerate(seqs):
            ids[b, : len(s)] = s
        logits = np.asarray(full_logits(state, jnp.asarray(ids)))
        for b, s in enumerate(seqs):
            s.append(int(np.argmax(logits[b, len(s) - 1])))
    assert plain.tokens == [s[len(p) :] for s, p in zip(seqs, PROMPTS)]
    # The target is mostly (not exactly) its bigram: context matters, so a broken cache changes tokens.
    succ = markov[2]
    follows = np.mean([succ[a] == b for row in plain.tokens for a, b in zip(row, row[1:])])
    assert 0.6 < follows < 1.0, follows


def _check_mixed_acceptance(res, max_accept: int, chain: bool = True):
    flat = [a for row in res.accepted for a in row]
    assert res.acceptance_length > 1.3, res.acceptance_length
    assert min(flat) < max_accept, "no rejection: the test would not cover rejected drafts"
    if chain:  # (a tree's siblings usually rescue a wrong first draft)
        assert 0 in flat, "no round rejecting its first draft"
    if max_accept >= 2:
        assert max(flat) >= 2, "no multi-token acceptance"
    assert all(0 <= a <= max_accept for a in flat)


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_spec_equals_plain(markov, runs, expected, eos, name):
    """Token for token equal to plain greedy decoding; rows stop right after EOS (others at max_new)."""
    spec = SPECS[name]
    res = runs(name, markov[1], spec)
    assert res.tokens == expected
    _check_mixed_acceptance(res, spec.max_emitted - 1, chain=spec.method == "chain")
    # The statistics are consistent with the per-round counts.
    flat = [a for row in res.accepted for a in row]
    assert res.acceptance_length == pytest.approx(np.mean(flat) + 1)
    assert res.position_acceptance == pytest.approx(
        [np.mean([a > i for a in flat]) for i in range(spec.max_emitted - 1)]
    )
    # Every row emitted 1 token at prefill and accepted + 1 per round, and ran no round after it stopped.
    for row, acc in zip(res.tokens, res.accepted):
        assert 1 + sum(a + 1 for a in acc[:-1]) < len(row) <= 1 + sum(a + 1 for a in acc)
        assert len(row) == MAX_NEW or row[-1] == eos


@pytest.mark.parametrize("name", ["chain3", "tree3x3x8"])
def test_greedy_eos_stops_rows_right_after_it(markov, runs, plain, eos, name):
    """Rows whose plain output contains EOS mid-way end exactly at its first occurrence; others run on."""
    res = runs(name, markov[1], SPECS[name])
    stopped = 0
    for row, ref in zip(res.tokens, plain.tokens):
        if eos in ref:
            cut = ref.index(eos) + 1
            assert row == ref[:cut] and eos not in row[:-1]
            stopped += cut < MAX_NEW
        else:
            assert row == ref and len(row) == MAX_NEW
    assert stopped >= 1


def test_greedy_draft_vocab_subset(markov, runs, expected, small_vocab_drafter):
    drafter, subset = small_vocab_drafter
    res = runs("chain3-vd24", drafter, CHAIN3)
    assert res.tokens == expected
    _check_mixed_acceptance(res, 3)
    # Tokens outside the draft vocabulary can never be drafted: a round whose next target token is
    # outside it rejects there, so acceptance is lower than with the full draft vocabulary.
    assert res.acceptance_length < runs("chain3", markov[1], CHAIN3).acceptance_length


# ------------------------------------------------------------------------------- 2. no cross-row leak


@pytest.mark.parametrize("name,row", [("chain3", 0), ("tree3x3x8", 2)])
def test_row_alone_equals_row_in_batch(markov, runs, name, row):
    """Row 0 alone pads to bucket 16, row 2 alone to 32: inside the batch both are padded to 32."""
    batch = runs(name, markov[1], SPECS[name])
    alone = runs(f"{name}-row{row}", markov[1], SPECS[name], prompts=[PROMPTS[row]])
    assert alone.tokens[0] == batch.tokens[row]
    assert alone.accepted[0] == batch.accepted[row]


@pytest.mark.parametrize("name,temperature", [("tree3x3x8", 0.0), ("chain3", 1.0)])
def test_attention_block_by_block_changes_nothing(monkeypatch, markov, name, temperature):
    """Attention over the cache in blocks (layers.softmax_over_blocks, made to read several small blocks
    here, which skips the ones no row reaches) gives the tokens and accepted drafts of one block over the
    whole cache, sampled runs (the same keys) included."""
    prompts, new = PROMPTS[:2], 64  # short prompts, long continuations: the rows cross several blocks
    kw = dict(max_new_tokens=new, spec=SPECS[name], temperature=temperature, seed=5, eos_token_id=[])
    runs = {}
    for block in (1 << 20, 16):
        monkeypatch.setattr(layers, "KV_BLOCK", block)
        monkeypatch.setattr(calls, "PROGRAMS", calls.Programs())  # trace again
        runs[block] = eagle_jax.generate(markov[0], markov[1], prompts, **kw)
    plan = calls.prepare(markov[0], markov[1], prompts, new, SamplingParams(temperature), SPECS[name], [], None)[0]
    assert plan.cache_len >= 3 * 16, plan
    assert runs[16].tokens == runs[1 << 20].tokens and runs[16].accepted == runs[1 << 20].accepted


# ------------------------------------------------------------------------------- 3. cache invariants


RECOMPUTE_WIDTH = 64  # >= any emitted sequence checked below (prompt 30 + 4 rounds of <= 4 tokens + 1)


@pytest.fixture(scope="module")
def recompute(markov):
    """From scratch over a padded sequence [B, 64]: the target's full forward (fresh cache, aux) and the
    drafter layer over the pairs (fuse(aux_t), token_{t+1}); jitted once (causal: padding is harmless)."""
    tg, ts = nnx.split(markov[0])
    dg, ds = nnx.split(markov[1])

    @jax.jit
    def run(ts, ds, ids):
        target, drafter = nnx.merge(tg, ts), nnx.merge(dg, ds)
        b, w = ids.shape
        positions = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
        mask = jnp.arange(w)[None, None, :] <= positions[:, :, None]
        zero = jnp.zeros((b,), jnp.int32)
        _, aux, t_cache = target.forward(
            ids, positions, mask, target.init_cache(b, w), zero, aux_layer_ids_for(drafter.config, target.config)
        )
        nxt = jnp.concatenate([ids[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
        normed, feat, d_cache = drafter.layer(drafter.fuse(aux), nxt, positions, mask, drafter.init_cache(b, w), zero)
        return t_cache, d_cache, feat, drafter.lm_head(normed)

    return lambda ids: run(ts, ds, ids)


def _check_invariant(recompute, prompts, st, atol=2e-5):
    """The LoopState invariant (state.py) against the from-scratch recompute over the emitted sequence.

    Target cache slots < length == a fresh full forward; drafter cache slots < length == the drafter
    layer over (fuse(target aux_t), token_{t+1}), i.e. TARGET features, not the drafter's own;
    d_logits / d_feat == its outputs at t = length - 1 (the pair whose token is ``pending``).
    """
    out, n_out, length, pending = (np.asarray(x) for x in jax.device_get((st.out, st.n_out, st.length, st.pending)))
    b = len(prompts)
    ids = np.zeros((b, RECOMPUTE_WIDTH), np.int32)
    for i, p in enumerate(prompts):
        seq = list(p) + out[i, : n_out[i]].tolist()  # positions 0..length (pending last)
        assert length[i] == len(p) + n_out[i] - 1 and pending[i] == seq[-1]
        ids[i, : len(seq)] = seq
    t_cache, d_cache, feat, d_logits = jax.device_get(recompute(jnp.asarray(ids)))
    got_t, got_d, got_feat, got_logits = jax.device_get((st.t_cache, st.d_cache, st.d_feat, st.d_logits))
    for i in range(b):
        n = int(length[i])
        for layer in range(len(t_cache.k)):
            np.testing.assert_allclose(
                got_t.k[layer][i, :, :n],
                t_cache.k[layer][i, :, :n],
                atol=atol,
                err_msg=f"target K layer {layer} row {i}",
            )
            np.testing.assert_allclose(
                got_t.v[layer][i, :, :n],
                t_cache.v[layer][i, :, :n],
                atol=atol,
                err_msg=f"target V layer {layer} row {i}",
            )
        np.testing.assert_allclose(got_d[0][i, :, :n], d_cache[0][i, :, :n], atol=atol, err_msg=f"drafter K row {i}")
        np.testing.assert_allclose(got_d[1][i, :, :n], d_cache[1][i, :, :n], atol=atol, err_msg=f"drafter V row {i}")
        np.testing.assert_allclose(got_feat[i], feat[i, n - 1], atol=atol, err_msg=f"d_feat row {i}")
        np.testing.assert_allclose(got_logits[i], d_logits[i, n - 1], atol=10 * atol, err_msg=f"d_logits row {i}")


@pytest.mark.parametrize(
    "spec,temperature",
    [(CHAIN3, 1.0), (TREE_A, 0.0)],
    ids=["chain-sampled", "tree-greedy"],
)
def test_caches_equal_recompute_after_each_round(markov, recompute, spec, temperature):
    """prefill + 4 rounds by hand (jitted over nnx.split states); the invariant holds after each."""
    target, drafter = markov[0], markov[1]
    plan, prompt, lens, rs = calls.prepare(
        target, drafter, PROMPTS, MAX_NEW, SamplingParams(temperature), spec, None, None
    )
    tg, ts = nnx.split(target)
    dg, ds = nnx.split(drafter)
    pre = jax.jit(
        lambda ts, ds, prompt, lens, key: start(
            nnx.merge(tg, ts), nnx.merge(dg, ds), plan, prompt, lens, rs, key, MAX_NEW
        )
    )
    step = jax.jit(lambda ts, ds, st: one_round(nnx.merge(tg, ts), nnx.merge(dg, ds), plan, st))
    st = pre(ts, ds, prompt, lens, jax.random.key(7))
    _check_invariant(recompute, PROMPTS, st)
    accepted = []
    for _ in range(4):
        st = step(ts, ds, st)
        accepted += np.asarray(st.accepted[:, int(st.rounds) - 1]).tolist()
        _check_invariant(recompute, PROMPTS, st)
    # Rejections and multi-token accepted paths were both covered.
    assert min(accepted) < spec.max_emitted - 1 and max(accepted) >= 2, accepted


# ------------------------------------------------------------------------- 4. sampling is lossless

N_SAMPLES = 6000
SAMPLE_PROMPT = [5, 1, 7, 2, 6]
P_THRESHOLD = 1e-3  # false-failure probability 0.1% per test (for a seed drawn at random; seeds are fixed)


def _gammaincc(a: float, x: float) -> float:
    """Regularised upper incomplete gamma Q(a, x) (series / Lentz continued fraction)."""
    if x <= 0:
        return 1.0
    log_pref = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        for _ in range(100000):
            n += 1
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(log_pref))
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 100000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(log_pref) * h


def g_test_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """G-test of observed counts against exact cell probabilities; cells expected < 5 pooled into one.

    An observation in a cell of probability 0 is an immediate failure (p-value 0).
    """
    counts, probs = counts.ravel().astype(np.float64), probs.ravel().astype(np.float64)
    if np.any(counts[probs <= 0] > 0):
        return 0.0
    n = counts.sum()
    expected = probs / probs.sum() * n
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    nz = obs > 0
    g = 2.0 * np.sum(obs[nz] * np.log(obs[nz] / exp[nz]))
    return _gammaincc((len(obs) - 1) / 2.0, g / 2.0)


def _transform(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The request's distribution over the last axis, written independently of the engine."""
    x = logits.astype(np.float64) / temperature
    out = np.zeros_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        row = x[idx]
        order = np.argsort(-row, kind="stable")
        keep = np.zeros(row.shape, bool)
        keep[order[: top_k or len(row)]] = True
        p = np.where(keep, np.exp(row - row.max()), 0.0)
        p /= p.sum()
        if top_p < 1.0:
            sp = p[order]
            before = np.cumsum(sp) - sp
            keep2 = np.zeros(row.shape, bool)
            keep2[order[before < top_p]] = True  # the smallest prefix reaching top_p
            p = np.where(keep2, p, 0.0)
            p /= p.sum()
        out[idx] = p
    return out


@pytest.fixture(scope="module")
def sampling_pair():
    """V = 8; one target layer (compile time): the acceptance rules do not depend on depth."""
    target, drafter = random_pair(vocab=8, hidden=32, seed=11, logit_scale=1.5, layers=1)
    return target, drafter


@pytest.fixture(scope="module")
def sample_refs(sampling_pair):
    """Full-sequence forwards after SAMPLE_PROMPT (one jitted program): the target's logits [V*V, 3, V]
    predicting t1, t2, t3 for every (t1, t2), and the drafter's first-draft distribution q(t2 | t1) [V, V]
    after prefill (pairs (fuse(aux_t), x_{t+1}) over prompt + t1, T = 1)."""
    target, drafter = sampling_pair
    v, n = target.config.vocab_size, len(SAMPLE_PROMPT)
    t1, t2 = np.meshgrid(np.arange(v), np.arange(v), indexing="ij")
    ids = np.concatenate([np.tile(SAMPLE_PROMPT, (v * v, 1)), t1.reshape(-1, 1), t2.reshape(-1, 1)], axis=1)
    tg, ts = nnx.split(target)
    dg, ds = nnx.split(drafter)

    @jax.jit
    def refs(ts, ds, ids):
        logits, aux = nnx.merge(tg, ts)(ids)
        rows = ids[::v, : n + 1]  # prompt + t1 (t2 = 0 rows)
        d_logits, _ = nnx.merge(dg, ds)(aux[::v, :n], rows[:, 1:])
        return logits[:, n - 1 :], jax.nn.softmax(d_logits[:, -1].astype(jnp.float32), axis=-1)

    logits, q2 = jax.device_get(refs(ts, ds, jnp.asarray(ids, jnp.int32)))
    q2 = np.asarray(q2, np.float64)
    return np.asarray(logits, np.float64), q2 / q2.sum(axis=1, keepdims=True)


@pytest.fixture(scope="module")
def sample_logits(sample_refs):
    return sample_refs[0]


def _exact_joint3(logits, temperature, top_k, top_p) -> np.ndarray:
    """P(t1, t2, t3) [V, V, V] from the logits of ``sample_logits`` under the request's transforms."""
    v = logits.shape[-1]
    p = _transform(logits, temperature, top_k, top_p)  # [V*V, 3, V]
    p1 = p[0, 0]
    p2 = p[::v, 1].reshape(v, v)  # rows with t2 = 0 give p(. | t1) at position n
    p3 = p[:, 2].reshape(v, v, v)
    return p1[:, None, None] * p2[:, :, None] * p3


def _counts3(tokens: list[list[int]], v: int) -> np.ndarray:
    counts = np.zeros((v, v, v))
    for row in tokens:
        assert len(row) == 3
        counts[tuple(row)] += 1
    return counts


SAMPLING_CASES = {
    "chain": dict(spec=SpecConfig(num_speculative_tokens=2), top_k=0, top_p=1.0),
    "chain-topk": dict(spec=SpecConfig(num_speculative_tokens=2), top_k=3, top_p=1.0),
    "chain-topp": dict(spec=SpecConfig(num_speculative_tokens=2), top_k=0, top_p=0.8),
    "tree": dict(spec=SpecConfig(method="tree", tree_top_k=3, tree_depth=2, tree_total_tokens=7), top_k=0, top_p=1.0),
    # spec="auto" switching depth every round (no drafts, a chain of 1, of 3): one loop state, each program's law.
    "auto-switching": dict(spec="auto", top_k=0, top_p=1.0, depths=(1, 0, 3)),
}
# Logits processors on the verification logits (decoding/penalties.py): every position of a round sees
# the counts of the drafts on its path; min_tokens = 3 holds token 7 (the EOS here) back at all three.
PENALTIES = dict(
    presence_penalty=0.5,
    frequency_penalty=0.7,
    repetition_penalty=1.3,
    logit_bias={3: 1.0, 5: -2.0},
    min_tokens=3,
    min_p=0.05,
    eos_token_id=[7],
)
SAMPLING_CASES["chain-penalties"] = dict(SAMPLING_CASES["chain"], pen=PENALTIES)
SAMPLING_CASES["tree-penalties"] = dict(SAMPLING_CASES["tree"], pen=PENALTIES)


def _exact_joint3_penalised(logits, pen: dict) -> np.ndarray:
    """``_exact_joint3`` at temperature 1 under ``pen``: position i's logits processed after t1..t_i."""
    v = logits.shape[-1]
    rules = {k: val for k, val in pen.items() if k not in ("min_p", "eos_token_id")}

    def p(row, pos, generated):
        return penalty_reference.probs(
            penalty_reference.processed(
                logits[row, pos], SAMPLE_PROMPT, generated, stop_ids=pen["eos_token_id"], **rules
            ),
            min_p=pen["min_p"],
        )

    out = np.zeros((v, v, v))
    p1 = p(0, 0, [])
    for t1 in range(v):
        p2 = p(t1 * v, 1, [t1])
        for t2 in range(v):
            out[t1, t2] = p1[t1] * p2[t2] * p(t1 * v + t2, 2, [t1, t2])
    return out


@pytest.fixture(scope="module")
def sampled(sampling_pair):
    memo = {}

    def get(name):
        if name not in memo:
            case = SAMPLING_CASES[name]
            target, drafter = sampling_pair
            with pytest.MonkeyPatch.context() as mp:
                if "depths" in case:
                    turns = itertools.cycle(case["depths"])
                    mp.setattr(chooser.Chooser, "choose", lambda *a, **k: next(turns))
                    mp.setattr(auto_run, "CHOOSE_EVERY", 1)
                    mp.setattr(auto_run, "PROFILE_ROUNDS", 1)
                res = eagle_jax.generate(
                    target,
                    drafter,
                    [SAMPLE_PROMPT] * N_SAMPLES,
                    max_new_tokens=3,
                    temperature=1.0,
                    top_k=case["top_k"],
                    top_p=case["top_p"],
                    spec=case["spec"],
                    seed=42,
                    **case.get("pen", {}),
                )
            memo[name] = res
        return memo[name]

    return get


@pytest.mark.parametrize("name", list(SAMPLING_CASES))
def test_sampling_keeps_target_distribution(sampling_pair, sample_logits, sampled, name):
    """Joint law of the first three generated tokens (t1 from prefill, t2/t3 from speculation) == target's."""
    target, _ = sampling_pair
    case = SAMPLING_CASES[name]
    res = sampled(name)
    if "pen" in case:
        exact = _exact_joint3_penalised(sample_logits, case["pen"])
        assert (
            g_test_pvalue(_counts3(res.tokens, target.config.vocab_size), _exact_joint3(sample_logits, 1.0, 0, 1.0))
            < 1e-6
        )
    else:
        exact = _exact_joint3(sample_logits, 1.0, case["top_k"], case["top_p"])
    counts = _counts3(res.tokens, target.config.vocab_size)
    pval = g_test_pvalue(counts, exact)
    assert pval > P_THRESHOLD, f"{name}: G-test p-value {pval:.2e}"
    # Both outcomes of the acceptance test happened. (With 3 tokens, 1 from the prefill, a round can
    # emit at most 2: ``accepted`` counts emitted drafts, so it is 0 or 1 here.)
    flat = [a for row in res.accepted for a in row]
    assert 0 in flat and 1 in flat
    if case["top_k"] or case["top_p"] < 1:
        assert np.all(counts[exact == 0] == 0)  # and the truncation really removes mass:
        assert _exact_joint3(sample_logits, 1.0, 0, 1.0)[exact == 0].sum() > 0.1


def test_sampling_test_has_power(sampling_pair, sample_refs, sampled):
    """The same G-test rejects the draft distribution q and a plausible wrong acceptance rule."""
    target = sampling_pair[0]
    res = sampled("chain")
    v = target.config.vocab_size
    exact = _exact_joint3(sample_refs[0], 1.0, 0, 1.0)
    p1 = exact.sum(axis=(1, 2))
    p2 = exact.sum(axis=2) / p1[:, None]
    p1, p2 = p1 / p1.sum(), p2 / p2.sum(axis=1, keepdims=True)
    q2 = sample_refs[1]
    counts12 = _counts3(res.tokens, v).sum(axis=2)
    assert g_test_pvalue(counts12, p1[:, None] * p2) > P_THRESHOLD
    # Output judged against "the draft is always accepted" (t2 ~ q): rejected.
    assert g_test_pvalue(counts12, p1[:, None] * q2) < 1e-6
    # A wrong rule simulated here: accept with min(1, p/q) but on rejection sample from p instead of the
    # residual max(p - q, 0). Same sample size, same test: rejected.
    rng = np.random.default_rng(0)
    wrong = np.zeros((v, v))
    t1s = rng.choice(v, size=N_SAMPLES, p=p1)
    for t1 in range(v):
        m = int(np.sum(t1s == t1))
        x = rng.choice(v, size=m, p=q2[t1])
        ok = rng.random(m) * q2[t1][x] < p2[t1][x]
        y = np.where(ok, x, rng.choice(v, size=m, p=p2[t1]))
        np.add.at(wrong[t1], y, 1)
    assert g_test_pvalue(wrong, p1[:, None] * p2) < 1e-6


def test_g_test_pvalues():
    """The chi-square tail used above, against known values."""
    assert _gammaincc(1.0, 2.0) == pytest.approx(math.exp(-2.0), rel=1e-12)
    # chi2.sf(x, df): df = 10, x = 23.209 -> 0.01; df = 60, x = 88.379 -> 0.01; df = 3, x = 16.266 -> 0.001
    assert _gammaincc(5.0, 23.2093 / 2) == pytest.approx(0.01, rel=1e-3)
    assert _gammaincc(30.0, 88.3794 / 2) == pytest.approx(0.01, rel=1e-3)
    assert _gammaincc(1.5, 16.2662 / 2) == pytest.approx(0.001, rel=1e-3)


# ------------------------------------------------------------------------------------------ 5. errors


@pytest.fixture(scope="module")
def pair32(markov):
    return markov[0], markov[1]


def test_spec_config_errors():
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SpecConfig(num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="tree_total_tokens=10"):
        SpecConfig(method="tree", tree_top_k=2, tree_depth=2, tree_total_tokens=10)  # at most 1 + 2 + 4
    with pytest.raises(ConfigError, match="tree_top_k"):
        SpecConfig(method="tree", tree_top_k=0, tree_depth=2, tree_total_tokens=2)
    with pytest.raises(ConfigError, match="method"):
        SpecConfig(method="beam")
    with pytest.raises(ConfigError, match="unknown fields"):
        SpecConfig.parse({"method": "eagle3", "num_speculative_token": 3})


def _raises(match, target, drafter, prompts, **kw):
    kw.setdefault("max_new_tokens", 4)
    with pytest.raises(ConfigError, match=match):
        eagle_jax.generate(target, drafter, prompts, **kw)


def test_generate_argument_errors(pair32):
    t, d = pair32
    ok = [[1, 2, 3]]
    _raises("num_speculative_tokens", t, d, ok, spec={"num_speculative_tokens": 0})
    _raises(
        "tree_total_tokens", t, d, ok, spec={"method": "tree", "tree_top_k": 2, "tree_depth": 2, "tree_total_tokens": 8}
    )
    _raises("max_position_embeddings", t, d, [list(range(32)) * 7], max_new_tokens=60)  # 224 + 60 > 256
    _raises("prompt 1 is empty", t, d, [[1], []])
    _raises("prompts is empty", t, d, [])
    _raises(r"outside the vocabulary \[0, 32\)", t, d, [[1, 32]])
    _raises("outside the vocabulary", t, d, [[-1, 2]])
    _raises("no tokenizer", t, d, ["hello"])
    _raises("single prompt", t, d, [1, 2, 3])
    _raises("top_p", t, d, ok, temperature=1.0, top_p=0.0)
    _raises("top_p", t, d, ok, temperature=1.0, top_p=1.5)
    _raises("temperature", t, d, ok, temperature=-0.5)
    _raises("top_k", t, d, ok, temperature=1.0, top_k=-1)
    _raises("max_new_tokens", t, d, ok, max_new_tokens=0)


def test_generate_mismatched_pair_errors(pair32):
    target = pair32[0]
    tc = target.config

    def abstract(config):  # the pair is checked before any array is touched
        return nnx.eval_shape(lambda: Drafter(config))

    other_vocab = abstract(drafter_config(target_config(40, 64)))
    _raises("drafter vocab_size=40 but the target's is 32", target, other_vocab, [[1, 2]])
    other_hidden = abstract(drafter_config(tc).replace(target_hidden_size=48))
    _raises("target_hidden_size=48 but the target's hidden_size is 64", target, other_hidden, [[1, 2]])
    two_aux = abstract(drafter_config(tc).replace(num_aux_hidden_states=2))
    _raises("num_aux_hidden_states=2 but it reads 3 target layers", target, two_aux, [[1, 2]])


# ----------------------------------------------------------------------------- 6. parse and streaming


def test_spec_parse_vllm_dict(markov, runs):
    spec = SpecConfig.parse({"method": "eagle3", "num_speculative_tokens": 3})
    assert spec == CHAIN3 and spec.method == "chain"
    assert SpecConfig.parse(None) == SpecConfig() and SpecConfig.parse(TREE_A) is TREE_A
    ref = runs("chain3", markov[1], CHAIN3)
    res = runs("chain3-dict", markov[1], {"method": "eagle3", "num_speculative_tokens": 3})
    assert res.tokens == ref.tokens and res.compile_s == 0.0  # the same plan: the same compiled program


def test_stream_yields_the_same_tokens(markov, runs, eos):
    ref = runs("chain3", markov[1], CHAIN3)
    chunks = list(
        eagle_jax.generate_stream(
            markov[0], markov[1], PROMPTS, max_new_tokens=MAX_NEW, rounds_per_chunk=3, spec=CHAIN3, eos_token_id=eos
        )
    )
    assert len(chunks) >= 3
    joined = [sum((c[b] for c in chunks), []) for b in range(len(PROMPTS))]
    assert joined == ref.tokens


def test_the_drafters_prefill_computes_outputs_only_where_drafting_starts():
    """A prompt's drafter entries need only their own pairs; the drafter's outputs only at the prompt's
    last position (``prefill._drafter_prompt``). Cache, logits and feature equal the whole layer over the
    block, for prompts of several lengths in a cache longer than them (``prefill``), and for the same
    prompt computed in chunks (``prefill_chunk``)."""
    from eagle_jax.decoding.engine import Plan
    from eagle_jax.decoding.prefill import prefill, prefill_chunk
    from eagle_jax.decoding.sampling import RowSampling
    from eagle_jax.modeling.layers import causal_mask

    target, drafter = random_pair(seed=3)
    rng = np.random.default_rng(0)
    lens = np.array([9, 5, 12])
    p, s = int(lens.max()), 20
    ids = rng.integers(0, 32, size=(3, p)).astype(np.int32)
    rs = RowSampling.fill(SamplingParams(), 3)
    keys = jax.random.split(jax.random.key(0), 3)
    got = prefill(
        target, drafter, Plan(3, s, 0, None, True, ()), jnp.asarray(ids), jnp.asarray(lens, jnp.int32), rs, keys
    )
    close = dict(rtol=1e-5, atol=1e-5)
    for i, n in enumerate(lens):  # the reference: the whole layer over the prompt's block
        row = jnp.asarray(ids[i : i + 1, :n])
        pos = jnp.arange(n, dtype=jnp.int32)[None]
        plan = Plan(1, n, 0, None, True, ())
        _, aux, _ = engine.target_forward(
            target, drafter, plan, row, pos, causal_mask(1, n), target.init_cache(1, n), jnp.zeros((1,), jnp.int32)
        )
        nxt = jnp.concatenate([row[:, 1:], got.first[i : i + 1, None]], axis=1)
        normed, feat, cache = drafter.layer(
            drafter.fuse(aux), nxt, pos, causal_mask(1, n), drafter.init_cache(1, n), jnp.zeros((1,), jnp.int32)
        )
        np.testing.assert_allclose(got.d_logits[i], drafter.lm_head(normed[0, n - 1]), **close)
        np.testing.assert_allclose(got.d_feat[i], feat[0, n - 1], **close)
        for got_c, ref_c in zip(got.d_cache, cache):
            np.testing.assert_allclose(got_c[i, :, :n], ref_c[0, :, :n], **close)
    # The longest prompt in chunks of 8 (the last one padded past the prompt), in a cache of 20.
    n = int(lens[2])
    t_cache, d_cache = target.init_cache(1, s), drafter.init_cache(1, s)
    for at in range(0, n, 8):
        chunk = np.zeros((1, 9), np.int32)
        part = ids[2:3, at : at + 9]
        chunk[:, : part.shape[1]] = part
        out = prefill_chunk(
            target,
            drafter,
            Plan(1, s, 0, None, True, ()),
            jnp.asarray(chunk),
            jnp.asarray([at], jnp.int32),
            jnp.asarray([n], jnp.int32),
            t_cache,
            d_cache,
            RowSampling.fill(SamplingParams(), 1),
            keys[2:],
        )
        t_cache, d_cache = out.t_cache, out.d_cache
    assert int(out.first[0]) == int(got.first[2])
    np.testing.assert_allclose(out.d_logits[0], got.d_logits[2], **close)
    np.testing.assert_allclose(out.d_feat[0], got.d_feat[2], **close)
    for chunk_c, got_c in zip(d_cache, got.d_cache):
        np.testing.assert_allclose(chunk_c[0, :, :n], got_c[2, :, :n], **close)
