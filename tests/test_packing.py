"""Packed TTT training (``data.batching: pack``): several documents per row, each attending only within
itself, give the numbers of the documents trained one per row; the pack Batcher; rematerialisation;
the trainer's tokens/s per padded length.

The key test: a tiny random target and drafter (Llama GQA; Mistral sliding window; DeepSeek-V3 MLA +
MoE with an MLA drafter) on 8 documents of 1 to 16 tokens, once one document per padded row through
the default path (no positions / segment ids: today's behaviour) and once packed 2-4 per row of 16.
Per-step loss (``normalize: valid``, a per-token mean), counts, accuracies and every drafter
gradient must agree. Tolerance (fp32 on CPU): the same math over
differently shaped batches (other reduction groupings, other XLA fusions), so agreement to a few ulp
of the accumulations: losses rtol 1e-5; gradients |g - g_ref| <= 1e-5 * max|g_ref| + 1e-7 per tensor.
A document that saw its neighbour (in the target, the drafter or the shifted labels) moves the loss
by O(1%) or more, which the test checks by giving the packed rows one segment each.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_models import deepseek_config, target_config
from flax import nnx

from eagle_jax import Target
from eagle_jax.config import aux_layer_ids_for
from eagle_jax.training import trainer, ttt
from eagle_jax.training.data import Batcher, DataError, DataPosition, Sample, collate, first_fit
from eagle_jax.training.trainer import TrainConfigError, build_drafter, load_config

jax.config.update("jax_default_matmul_precision", "highest")

LOSS_RTOL = 1e-5
GRAD_REL = 1e-5
GRAD_ABS = 1e-7
TTT_LENGTH = 4
ROW = 16
# Rows of documents: one full row ending exactly at a boundary, 4 documents in one row, a 1-token
# document (nothing to supervise), a document alone filling its row, padding after the last document.
LENGTHS = [5, 11, 7, 3, 4, 2, 16, 9, 1]
ROWS = [[0, 1], [2, 3, 4, 5], [6], [7, 8]]
VOCAB = 24
DRAFT_VOCAB = 16


def documents(seed: int = 0) -> list[Sample]:
    """Random tokens; every other document has a 2-token prompt (no loss) and the others are learned
    from their first token on, so labels taken across a boundary would count."""
    rng = np.random.default_rng(seed)
    out = []
    for k, n in enumerate(LENGTHS):
        mask = np.ones(n, np.uint8)
        if k % 2:
            mask[:2] = 0
        out.append(Sample(rng.integers(0, VOCAB, n).astype(np.int32), mask))
    return out


def make_pair(kind: str) -> tuple[Target, object]:
    """A random target (peaked logits, so accuracies are not all zero) and a fresh EAGLE-3.1 drafter
    built as the trainer builds it (MLA for the DeepSeek target), Vd < V with a data-built vocab map."""
    if kind == "mla":
        tc = deepseek_config(VOCAB, hidden=64)
    else:
        tc = target_config(VOCAB, hidden=32, sliding_window=6 if kind == "window" else None)
    target = Target(tc, rngs=nnx.Rngs(3))
    target.lm_head.kernel.set_value(target.lm_head.kernel[...] * 4.0)
    cfg = load_config(
        None, [f"drafter.draft_vocab_size={DRAFT_VOCAB}", "drafter.fc_norm=true", "drafter.norm_output=true"]
    )
    drafter, _ = build_drafter(cfg, target, documents())
    return target, drafter


_PROGRAMS: dict = {}


def loss_and_grads(target, drafter, batch: dict, *, documents_apart: bool, remat: bool = False):
    """(TTTOutput, target logits, drafter gradients) of one batch, as the train step computes them
    (``normalize: valid``). ``documents_apart`` False: no positions / segment ids (today's default
    path), or, for packed rows, ``"mixed"``: one segment per row at running positions (the packed
    rows' program, its documents seeing each other). One compiled program per pair and path."""
    graphdef_t, target_state = nnx.split(target)
    graphdef_d, params, rest = nnx.split(drafter, nnx.Param, ...)
    aux_ids = aux_layer_ids_for(drafter.config, target.config)
    if documents_apart == "mixed":
        ids = batch["input_ids"]
        pos, seg = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape), np.ones(ids.shape, np.int32)
    else:
        pos, seg = (batch["positions"], batch["segment_ids"]) if documents_apart else (None, None)
    key = (id(target), id(drafter), pos is None, remat)
    if key not in _PROGRAMS:

        @jax.jit
        def run(target_state, params, ids, mask, pos, seg):
            logits, aux = nnx.merge(graphdef_t, target_state)(ids, aux_ids, pos, seg)

            def f(p):
                out = ttt.ttt_loss(
                    nnx.merge(graphdef_d, p, rest),
                    aux,
                    ids,
                    logits,
                    mask,
                    ttt_length=TTT_LENGTH,
                    normalize="valid",
                    positions=pos,
                    segment_ids=seg,
                    remat=remat,
                )
                return out.total, out

            (_, out), grads = jax.value_and_grad(f, has_aux=True)(params)
            return out, logits, grads

        _PROGRAMS[key] = run
    return _PROGRAMS[key](
        target_state, params, jnp.asarray(batch["input_ids"]), jnp.asarray(batch["loss_mask"]), pos, seg
    )


def assert_grads_close(got, want) -> None:
    for (path, g), (_, w) in zip(nnx.to_flat_state(got), nnx.to_flat_state(want)):
        g, w = np.asarray(g.get_value()), np.asarray(w.get_value())
        assert np.abs(w).max() > 0, path
        np.testing.assert_allclose(g, w, rtol=0, atol=GRAD_REL * np.abs(w).max() + GRAD_ABS, err_msg=str(path))


@pytest.mark.parametrize("kind", ["gqa", "window", "mla"])
def test_packed_documents_give_the_loss_and_gradients_of_separate_rows(kind, request):
    target, drafter = request.getfixturevalue("gqa_pair") if kind == "gqa" else make_pair(kind)
    docs = documents()
    alone = collate(docs, [np.array([i]) for i in range(len(docs))], ROW)  # one document per row
    packed = collate(docs, [np.array(r) for r in ROWS], ROW)
    assert packed["input_ids"].shape == (4, ROW) and (packed["segment_ids"][0] > 0).all()

    ref, ref_logits, ref_grads = loss_and_grads(target, drafter, alone, documents_apart=False)
    out, logits, grads = loss_and_grads(target, drafter, packed, documents_apart=True)
    np.testing.assert_array_equal(out.counts, ref.counts)
    np.testing.assert_allclose(out.accuracies, ref.accuracies, rtol=LOSS_RTOL)
    np.testing.assert_allclose(out.losses, ref.losses, rtol=LOSS_RTOL)  # a per-token mean: packing leaves it unchanged
    np.testing.assert_allclose(out.total, ref.total, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads)
    assert float(np.sum(ref.accuracies)) > 0 and int(ref.counts[-1]) > 0  # not vacuous

    # The target sees each document alone too: its logits at every document's tokens.
    for r, row in enumerate(ROWS):
        start = 0
        for i in row:
            n = LENGTHS[i]
            np.testing.assert_allclose(
                logits[r, start : start + n],
                ref_logits[i, :n],
                rtol=0,
                atol=LOSS_RTOL * float(np.abs(ref_logits).max()),
            )
            start += n

    # The same packed rows as one sequence each (documents see each other) give another loss.
    mixed, _, _ = loss_and_grads(target, drafter, packed, documents_apart="mixed")
    assert not np.allclose(mixed.losses, ref.losses, rtol=1e-2)


@pytest.fixture(scope="module")
def gqa_pair():
    return make_pair("gqa")


def test_remat_gives_the_same_loss_and_gradients(gqa_pair):
    """The same forward recomputed: equal up to fp32 rounding (XLA fuses the recomputation its own
    way; observed gradient differences ~1e-7 of a tensor's largest entry)."""
    target, drafter = gqa_pair
    packed = collate(documents(), [np.array(r) for r in ROWS], ROW)
    out, _, grads = loss_and_grads(target, drafter, packed, documents_apart=True)
    out_r, _, grads_r = loss_and_grads(target, drafter, packed, documents_apart=True, remat=True)
    np.testing.assert_allclose(out_r.losses, out.losses, rtol=1e-6)
    np.testing.assert_array_equal(out_r.counts, out.counts)
    np.testing.assert_allclose(out_r.accuracies, out.accuracies, rtol=1e-6)
    for (path, g), (_, w) in zip(nnx.to_flat_state(grads_r), nnx.to_flat_state(grads)):
        g, w = np.asarray(g.get_value()), np.asarray(w.get_value())
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6 * np.abs(w).max() + 1e-9, err_msg=str(path))


# ------------------------------------------------------------------------------------------ Batcher


def _samples(n: int, lo: int, hi: int, seed: int = 0) -> list[Sample]:
    """Sample i is ``n_i`` copies of token i + 10 (every token names its sample)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(lo, hi + 1))
        out.append(Sample(np.full(length, i + 10, np.int32), (rng.random(length) < 0.7).astype(np.uint8)))
    return out


def test_first_fit_is_first_fit():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 33, 500)
    bins, free = [], []
    for i, n in enumerate(lengths):  # the plain quadratic first fit
        k = next((k for k, f in enumerate(free) if f >= n), len(bins))
        if k == len(bins):
            bins.append([])
            free.append(32)
        bins[k].append(i)
        free[k] -= n
    assert first_fit(lengths, 32) == bins


def _check_packed_batch(batch: dict, samples: list[Sample], max_length: int) -> list[int]:
    """The documents of each row, back to back from slot 0, with their tokens, masks, restarted
    positions and segment ids 1, 2, ...; then padding (segment 0, no loss). Returns the sample ids."""
    seen = []
    for ids, mask, pos, seg in zip(batch["input_ids"], batch["loss_mask"], batch["positions"], batch["segment_ids"]):
        start, k = 0, 1
        while start < max_length and seg[start] != 0:
            i = int(ids[start]) - 10
            n = len(samples[i])
            assert (seg[start : start + n] == k).all() and (start + n == max_length or seg[start + n] != k)
            np.testing.assert_array_equal(ids[start : start + n], samples[i].input_ids)
            np.testing.assert_array_equal(mask[start : start + n], samples[i].loss_mask)
            np.testing.assert_array_equal(pos[start : start + n], np.arange(n))
            seen.append(i)
            start, k = start + n, k + 1
        assert (seg[start:] == 0).all() and (mask[start:] == 0).all() and (ids[start:] == 1).all()
    return seen


def test_pack_batching_epochs_positions_segments_and_resume():
    samples = _samples(120, 3, 20)
    b = Batcher(samples, batch_size=3, max_length=32, mode="pack", seed=5, pad_id=1)
    assert b.batches_per_epoch == b.num_batches(0)
    for epoch in (0, 1):
        seen, tokens = [], 0
        for k in range(b.num_batches(epoch)):
            batch = b.batch(DataPosition(epoch, k))
            assert set(batch) == {"input_ids", "loss_mask", "positions", "segment_ids"}
            assert batch["input_ids"].shape == (3, 32)
            seen += _check_packed_batch(batch, samples, 32)
            tokens += int((batch["segment_ids"] > 0).sum())
        assert len(seen) == len(set(seen))  # each sample at most once per epoch
        # Dropped: only the samples of the last incomplete batch (fewer than 3 rows).
        missing = sum(len(samples[i]) for i in set(range(len(samples))) - set(seen))
        assert missing <= 2 * 32
        assert tokens / (b.num_batches(epoch) * 3 * 32) > 0.85  # rows are well filled (~1.5 tokens lost per row here)
        assert len(seen) > 2 * 3 * b.num_batches(epoch)  # several documents per row

    # Deterministic per (seed, epoch); another epoch or seed packs differently.
    def stream(batcher, epoch):
        return [batcher.batch(DataPosition(epoch, k))["input_ids"].tolist() for k in range(batcher.num_batches(epoch))]

    first = stream(b, 0)
    assert first == stream(Batcher(samples, batch_size=3, max_length=32, mode="pack", seed=5, pad_id=1), 0)
    assert first != stream(b, 1)
    assert first != stream(Batcher(samples, batch_size=3, max_length=32, mode="pack", seed=6, pad_id=1), 0)

    # Resumable from any position, across epoch boundaries.
    n = b.num_batches(0) + b.num_batches(1) + 3
    it = b.iterate()
    full = [next(it) for _ in range(n)]
    assert full[b.num_batches(0)][0] == DataPosition(1, 0)
    resumed = Batcher(samples, batch_size=3, max_length=32, mode="pack", seed=5, pad_id=1).iterate(full[7][0])
    for p, batch in full[7:]:
        q, batch2 = next(resumed)
        assert p == q
        for key in batch:
            np.testing.assert_array_equal(batch[key], batch2[key])


def test_pad_and_bucket_batches_carry_positions_and_segments():
    samples = _samples(40, 3, 20)
    for mode in ("pad", "bucket"):
        b = Batcher(
            samples,
            batch_size=4,
            max_length=32,
            mode=mode,
            buckets=(16, 32) if mode == "bucket" else None,
            seed=0,
            pad_id=1,
        )
        batch = b.batch(DataPosition(0, 0))
        length = batch["input_ids"].shape[1]
        np.testing.assert_array_equal(batch["positions"], np.tile(np.arange(length), (4, 1)))
        lengths = [len(samples[int(row[0]) - 10]) for row in batch["input_ids"]]
        np.testing.assert_array_equal(batch["segment_ids"], np.arange(length)[None, :] < np.array(lengths)[:, None])
        assert _check_packed_batch(batch, samples, length) == [int(row[0]) - 10 for row in batch["input_ids"]]


def test_pack_errors():
    with pytest.raises(DataError, match="sample 0 has 20 tokens > max_length 16"):
        Batcher([Sample(np.zeros(20, np.int32), np.ones(20, np.uint8))] * 4, batch_size=2, max_length=16, mode="pack")
    with pytest.raises(DataError, match="do not fill one batch of 4 rows"):
        Batcher(_samples(6, 3, 8), batch_size=4, max_length=32, mode="pack")
    with pytest.raises(DataError, match="'pad' or 'bucket' .* or 'pack'"):
        Batcher(_samples(8, 3, 8), batch_size=2, max_length=8, mode="sorted")


# ------------------------------------------------------------------------------------------ trainer

TRAIN = [
    "target.random={vocab_size: 64, hidden_size: 32, intermediate_size: 64, num_layers: 3, num_heads: 4, num_kv_heads: "
    "2, head_dim: 8, logit_scale: 4.0}",
    "data.synthetic={num_samples: 1}",
    "data.max_length=32",
    "train.batch_size=4",
    "train.ttt_length=3",
    "train.lr=1e-3",
    "checkpoint.every=0",
    "log.every=1",
    "log.progress=false",
]


@pytest.fixture
def short_samples(monkeypatch):
    """Training data of 4-32 tokens (the synthetic recipe's samples all have max_length tokens)."""
    samples = [Sample(s.input_ids % 64, s.loss_mask) for s in _samples(48, 4, 32, seed=1)]
    monkeypatch.setattr(trainer, "build_samples", lambda cfg, target: (samples, 0, f"{len(samples)} test samples"))
    return samples


def test_packed_run_with_remat_logs_lengths_and_tokens_per_s(short_samples, tmp_path):
    steps = 4
    cfg = load_config(
        None, TRAIN + [f"run_dir={tmp_path}", f"train.steps={steps}", "data.batching=pack", "train.remat=true"]
    )
    summary = trainer.train(cfg)
    recs = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, steps + 1)) and all(np.isfinite(r["loss"]) for r in recs)
    assert all(r["lengths"] == [32] for r in recs)
    assert recs[0]["step_tokens_per_s"] == [None] and recs[0]["tokens_per_s"] is None  # it compiled
    assert all(r["step_tokens_per_s"][0] > 0 and r["tokens_per_s"] == r["step_tokens_per_s"][0] for r in recs[1:])
    assert list(summary["tokens_per_s_by_length"]) == [32] and summary["tokens_per_s_by_length"][32] > 0


def test_bucketed_run_reports_tokens_per_s_per_length(short_samples, tmp_path):
    cfg = load_config(
        None, TRAIN + [f"run_dir={tmp_path}", "data.batching=bucket", "data.buckets=[16, 32]", "log.every=3"]
    )
    batcher = Batcher(short_samples, 4, 32, mode="bucket", buckets=(16, 32), seed=0)
    lengths = [batcher.batch(DataPosition(0, k))["input_ids"].shape[1] for k in range(batcher.batches_per_epoch)]
    steps = batcher.batches_per_epoch
    assert sorted(set(lengths)) == [16, 32] and min(lengths.count(16), lengths.count(32)) >= 2
    cfg["train"]["steps"] = steps
    summary = trainer.train(cfg)
    recs = summary["records"]
    assert sum((r["lengths"] for r in recs), []) == lengths  # each step's padded length, in order
    per_step = sum((r["step_tokens_per_s"] for r in recs), [])
    first = {n: lengths.index(n) for n in (16, 32)}  # each length's first step compiled: not timed
    assert all((per_step[k] is None) == (k in first.values()) for k in range(steps))
    assert sorted(summary["tokens_per_s_by_length"]) == [16, 32] and all(
        v > 0 for v in summary["tokens_per_s_by_length"].values()
    )


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("data.batching", "sorted", "data.batching='sorted'; expected one of: pad, bucket, pack"),
        ("train.remat", "'yes'", "train.remat='yes'; expected true or false"),
        ("train.normalize", "mean", "train.normalize='mean'; expected one of: all, valid"),
    ],
)
def test_bad_values_are_config_errors(key, value, match, tmp_path):
    with pytest.raises(TrainConfigError, match=match):
        trainer.train(load_config(None, TRAIN + [f"run_dir={tmp_path}", f"{key}={value}"]))
