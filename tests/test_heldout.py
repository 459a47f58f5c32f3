"""Held-out TTT accuracy during training (``eval.path``): logged every ``eval.every`` steps, from features too.

A tiny random target over the bundled tokenizer's vocabulary, text samples written here: the held-out figures
must be the TTT accuracy of the drafter at that step on those samples alone (recomputed here from the exported
drafter), the same online and from features, and cut into batches any way.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from bench.training_curve import curve
from eagle_jax import load_drafter
from eagle_jax.checkpoint.tokenizer import load_tokenizer
from eagle_jax.training.data import load_samples
from eagle_jax.training.recipe import TrainConfigError, check_config
from eagle_jax.training.trainer import build_target, load_config, merge_config, train
from eagle_jax.training.ttt import ttt_loss

TOKENIZER = "assets/tokenizer"
WORDS = "the a drafter target token reads writes every step model fast slow cache row batch loss".split()


def write_texts(path, n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS, int(rng.integers(5, 14))))}) + "\n")
    return str(path)


def config(tmp_path, **sections) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    base = {
        "seed": 0,
        # vocab_size: the bundled tokenizer's
        "target": {
            "random": {
                "vocab_size": 6144,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_layers": 3,
                "num_heads": 4,
                "num_kv_heads": 2,
                "head_dim": 8,
                "logit_scale": 8.0,
            }
        },
        "drafter": {"draft_vocab_size": 256, "norm_output": True, "fc_norm": True},
        "data": {
            "path": write_texts(tmp_path / "train.jsonl", 48, 0),
            "tokenizer": TOKENIZER,
            "max_length": 32,
            "batching": "pack",
        },
        "eval": {"path": write_texts(tmp_path / "heldout.jsonl", 12, 1), "every": 4},
        "train": {"steps": 8, "batch_size": 2, "lr": 3e-3, "warmup_steps": 1, "ttt_length": 2},
        "checkpoint": {"every": 0},
        "log": {"every": 2, "progress": False},
        "run_dir": str(tmp_path / "run"),
    }
    return merge_config(merge_config(load_config(), base), sections)


def test_heldout_accuracy_is_logged_and_is_the_drafters_own(tmp_path):
    cfg = config(tmp_path)
    summary = train(cfg)
    evaluated = [r for r in summary["records"] if "heldout_acc_per_position" in r]
    assert [r["step"] for r in evaluated] == [0, 4, 8]  # step 0: the drafter as training starts
    last = evaluated[-1]
    assert len(last["heldout_acc_per_position"]) == 2 and last["heldout_positions"] > 0
    # The same figure from the exported drafter over the held-out samples, one per row.
    target = build_target(cfg)
    drafter = load_drafter(summary["export_dir"], target, jnp.float32)
    tok = load_tokenizer(TOKENIZER)
    samples, _ = load_samples([cfg["eval"]["path"]], tok, 32, progress=False)
    correct = np.zeros(2)
    counts = np.zeros(2)
    for s in samples:
        ids = jnp.asarray(s.input_ids[None])
        logits, aux = target(ids, drafter.config.aux_layer_ids)
        out = ttt_loss(drafter, aux, ids, logits, jnp.asarray(s.loss_mask[None]), ttt_length=2, normalize="valid")
        correct += np.asarray(out.accuracies) * np.asarray(out.counts)
        counts += np.asarray(out.counts)
    np.testing.assert_allclose(
        last["heldout_acc_per_position"], correct / counts, atol=2e-3
    )  # fp32 sums in another order: a near-tie may flip
    assert last["heldout_positions"] == int(counts[0])
    # bench.training_curve reads the same records, against the tokens trained so far
    points = curve([tmp_path / "run"])
    assert [p["step"] for p in points] == [0, 4, 8] and 0 == points[0]["tokens"] < points[1]["tokens"] < points[2][
        "tokens"
    ]
    assert points[2]["heldout_simulated_al"] == last["heldout_simulated_al"]


def test_heldout_from_features_matches_online(tmp_path):
    online = train(config(tmp_path / "a"))
    cached = train(
        config(tmp_path / "b", data={"features": str(tmp_path / "f")}, eval={"features": str(tmp_path / "fe")})
    )
    a = [r for r in online["records"] if "heldout_loss_per_position" in r]
    b = [r for r in cached["records"] if "heldout_loss_per_position" in r]
    np.testing.assert_allclose(
        [r["heldout_loss_per_position"] for r in b], [r["heldout_loss_per_position"] for r in a], rtol=1e-4
    )


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"data": {"features": "f"}}, "eval.features and data.features go together"),
        ({"eval": {"every": 3}}, "must be a multiple of log.every"),
    ],
)
def test_bad_eval_settings_are_refused(tmp_path, sections, message):
    with pytest.raises(TrainConfigError, match=message):
        check_config(config(tmp_path, **sections))
