"""Training from precomputed target features (``data.features``) is training with the target in the step.

A tiny random target and synthetic data. The features are float32, as the online target's outputs are,
so the two runs see the same numbers up to the order of fp32 sums (the target runs on different row
shapes): we hold the loss curves to 1e-4 relative over 12 steps (observed ~1e-6), far below the
O(1e-2) change of one lost gradient step at this learning rate.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from eagle_jax.config import default_aux_layer_ids
from eagle_jax.training import features as F
from eagle_jax.training.data import Sample
from eagle_jax.training.trainer import build_target, load_config, merge_config, train

BASE = {
    "seed": 0,
    "target": {
        "random": {
            "vocab_size": 256,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_layers": 3,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 8,
            "logit_scale": 8.0,
        }
    },
    "drafter": {"draft_vocab_size": 128, "norm_output": True, "fc_norm": True},
    "data": {"synthetic": {"num_samples": 64, "prompt_length": 4}, "max_length": 32, "batching": "pack"},
    "train": {"steps": 12, "batch_size": 4, "lr": 3e-3, "warmup_steps": 2, "ttt_length": 3},
    "checkpoint": {"every": 0},
    "log": {"every": 1, "progress": False},
}


def config(tmp_path, **sections) -> dict:
    cfg = merge_config(load_config(), BASE)
    return merge_config(cfg, {"run_dir": str(tmp_path / "run"), **sections})


def ragged_samples(n: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(3, 20))
        out.append(Sample(rng.integers(0, 256, length).astype(np.int32), np.ones(length, np.uint8)))
    return out


def test_training_from_features_follows_the_online_loss_curve(tmp_path):
    online = train(config(tmp_path / "a"))
    cached = train(config(tmp_path / "b", data={"features": str(tmp_path / "features")}))
    a = np.array([r["loss"] for r in online["records"]])
    b = np.array([r["loss"] for r in cached["records"]])
    assert len(a) == len(b) == 12
    np.testing.assert_allclose(b, a, rtol=1e-4)
    assert a[-1] < a[0] * 0.9, "the runs learn"
    acc_a = np.array([r["acc_per_position"] for r in online["records"]])
    acc_b = np.array([r["acc_per_position"] for r in cached["records"]])
    np.testing.assert_allclose(acc_b, acc_a, atol=1e-3)
    # A second run on the same data reads the features back instead of computing them again.
    manifest = json.loads((tmp_path / "features" / "manifest.json").read_text())
    assert manifest["done"] == manifest["samples"] == 64


def test_features_match_the_target_and_resume_after_a_stop(tmp_path):
    target = build_target(config(tmp_path))
    aux_ids = default_aux_layer_ids(target.config.num_layers)
    samples = ragged_samples(23)
    store = F.compute_features(target, samples, aux_ids, tmp_path / "f", rows=2, length=32, progress=False)
    for i in (0, 7, 22):  # each sample's rows equal the target run on that sample alone
        logits, aux = target(samples[i].input_ids[None], aux_ids)
        lo, hi = store.offsets[i], store.offsets[i + 1]
        np.testing.assert_allclose(store.aux[lo:hi], np.asarray(aux[0]), atol=2e-5)
        np.testing.assert_array_equal(store.argmax[lo:hi], np.asarray(logits[0]).argmax(-1))
    # Stopped after 9 samples: the manifest says so and the rest is garbage; the resumed run completes it.
    full = {k: np.array(getattr(store, k)) for k in ("aux", "hidden", "argmax")}
    manifest = json.loads((tmp_path / "f" / "manifest.json").read_text())
    cut = int(store.offsets[9])
    maps = F._memmaps(tmp_path / "f", manifest["tokens"], manifest["aux_width"], manifest["hidden_size"], "r+")
    for m in maps.values():
        m[cut:] = 7
        m.flush()
    (tmp_path / "f" / "manifest.json").write_text(json.dumps({**manifest, "done": 9}))
    resumed = F.compute_features(target, samples, aux_ids, tmp_path / "f", rows=2, length=32, progress=False)
    for k, v in full.items():
        np.testing.assert_array_equal(getattr(resumed, k), v)


def test_features_of_another_target_or_other_data_are_refused(tmp_path):
    target = build_target(config(tmp_path))
    aux_ids = default_aux_layer_ids(target.config.num_layers)
    samples = ragged_samples(6)
    F.compute_features(target, samples, aux_ids, tmp_path / "f", length=32, progress=False)
    with pytest.raises(F.FeatureError, match="training data"):
        F.compute_features(target, ragged_samples(6, seed=1), aux_ids, tmp_path / "f", length=32, progress=False)
    other = build_target(config(tmp_path, seed=1))
    with pytest.raises(F.FeatureError, match="target"):
        F.compute_features(other, samples, aux_ids, tmp_path / "f", length=32, progress=False)
    with pytest.raises(F.FeatureError, match="aux layers"):
        F.compute_features(target, samples, (1, 2), tmp_path / "f", length=32, progress=False)
    (tmp_path / "f" / "hidden.f32").write_bytes(b"short")
    with pytest.raises(F.FeatureError, match="incomplete or damaged"):
        F.compute_features(target, samples, aux_ids, tmp_path / "f", length=32, progress=False)


def test_feature_batches_pack_consecutive_samples_first_fit():
    """Each batch takes the next samples in order (finished samples stay a prefix), every row within its length,
    every sample once; first fit fills rows where the next sample would not have fitted the last row."""
    lengths = np.array([700, 500, 300, 200, 600, 400, 100, 1000, 50])
    batches = F._batches(lengths, 0, 2, 1024)
    assert batches[0][0] == 0 and batches[-1][1] == len(lengths)
    assert all(a[1] == b[0] for a, b in zip(batches, batches[1:]))
    for first, end, rows in batches:
        assert sorted(i for row in rows for i in row) == list(range(first, end))
        assert all(sum(lengths[i] for i in row) <= 1024 for row in rows)
    assert batches[0][2] == [[0, 2], [1, 3]]  # 300 goes back to the first row, which next fit had closed
    assert F._batches(lengths, 5, 2, 1024)[0][0] == 5  # a resumed computation starts where it stopped
