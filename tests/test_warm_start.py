"""A drafter started from the target (``drafter.warm_start``) and parts of it kept as they start (``train.freeze``).

A tiny random target trains for a few steps: the warm parts must equal the target's at the start, frozen ones
must stay bitwise equal to it after training while the rest moves, the exported drafter must hold them, and
a resumed run must rebuild them. Bad names are refused naming the key.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle_jax import load_drafter
from eagle_jax.training.recipe import TrainConfigError, build_drafter, build_samples, check_config, trainable_mask
from eagle_jax.training.trainer import DEFAULTS, build_target, merge_config, train

CONFIG = {
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
    "drafter": {"draft_vocab_size": 128, "norm_output": True, "fc_norm": True, "warm_start": ["lm_head", "norm", "fc"]},
    "data": {"synthetic": {"num_samples": 64, "prompt_length": 4}, "max_length": 32},
    "train": {
        "steps": 6,
        "batch_size": 8,
        "lr": 3e-3,
        "warmup_steps": 1,
        "ttt_length": 2,
        "freeze": ["lm_head", "norm"],
    },
    "checkpoint": {"every": 3, "keep": 2},
    "log": {"every": 1, "progress": False},
}


def config(run_dir, **sections) -> dict:
    cfg = merge_config(DEFAULTS, copy.deepcopy(CONFIG))
    for section, values in sections.items():
        cfg[section].update(values)
    cfg["run_dir"] = str(run_dir)
    return cfg


def target_head_rows(target, drafter) -> np.ndarray:
    used = np.arange(drafter.config.draft_vocab_size) + np.asarray(drafter.d2t[...])
    head = target.embed_tokens[...] if target.lm_head is None else target.lm_head.kernel[...].T
    return np.asarray(head)[used]


def test_warm_parts_start_as_the_targets(tmp_path):
    cfg = config(tmp_path / "run")
    target = build_target(cfg)
    samples, _, _ = build_samples(cfg, target)
    drafter, note = build_drafter(cfg, target, samples)
    assert "lm_head, norm, fc started from the target" in note
    np.testing.assert_array_equal(np.asarray(drafter.lm_head.kernel[...]).T, target_head_rows(target, drafter))
    np.testing.assert_array_equal(np.asarray(drafter.norm.weight[...]), np.asarray(target.norm.weight[...]))
    # fc: the fused feature is the last aux state (after its 3.1 norm)
    aux = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 3 * 32)), jnp.float32)
    np.testing.assert_allclose(np.asarray(drafter.fuse(aux)), np.asarray(drafter.fc_norm[2](aux[..., 64:])), atol=1e-6)
    fresh, _ = build_drafter(
        config(tmp_path / "cold", **{"drafter": {**CONFIG["drafter"], "warm_start": []}}), target, samples
    )
    assert not np.allclose(np.asarray(fresh.lm_head.kernel[...]), np.asarray(drafter.lm_head.kernel[...]))


def test_frozen_parts_stay_and_the_rest_trains_and_resumes(tmp_path):
    cfg = config(tmp_path / "run")
    target = build_target(cfg)
    summary = train(cfg, stop_after=3)
    assert summary["step"] == 3
    summary = train(cfg)  # resumes from step 3: the frozen parts are rebuilt from the target
    assert summary["step"] == 6
    trained = load_drafter(summary["export_dir"], target, jnp.float32)
    samples, _, _ = build_samples(cfg, target)
    start, _ = build_drafter(cfg, target, samples)
    np.testing.assert_array_equal(np.asarray(trained.lm_head.kernel[...]), np.asarray(start.lm_head.kernel[...]))
    np.testing.assert_array_equal(np.asarray(trained.norm.weight[...]), np.asarray(start.norm.weight[...]))
    assert not np.allclose(np.asarray(trained.fc.kernel[...]), np.asarray(start.fc.kernel[...]))
    assert not np.allclose(np.asarray(trained.mlp.down_proj.kernel[...]), np.asarray(start.mlp.down_proj.kernel[...]))


def test_the_trainable_mask_leaves_out_exactly_the_frozen_modules():
    cfg = merge_config(DEFAULTS, copy.deepcopy(CONFIG))
    target = build_target(cfg)
    samples, _, _ = build_samples(cfg, target)
    drafter, _ = build_drafter(cfg, target, samples)
    _, params, _ = nnx.split(drafter, nnx.Param, ...)
    mask = trainable_mask(params, ["lm_head", "norm"])
    flat = dict(
        zip(
            (
                "/".join(str(getattr(k, "key", k)) for k in path)
                for path, _ in jax.tree_util.tree_flatten_with_path(mask)[0]
            ),
            jax.tree.leaves(mask),
        )
    )
    assert not any(v for k, v in flat.items() if k.startswith(("lm_head/", "norm/")))
    assert all(v for k, v in flat.items() if not k.startswith(("lm_head/", "norm/")))


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"drafter": {"warm_start": ["head"]}}, "drafter.warm_start has ['head']"),
        ({"drafter": {"warm_start": "lm_head"}}, "drafter.warm_start='lm_head'; expected a list"),
        ({"drafter": {"warm_start": ["fc"], "init": "some/drafter"}}, "set one of them"),
    ],
)
def test_bad_warm_start_is_refused_naming_the_key(tmp_path, sections, message):
    cfg = config(tmp_path, **sections)
    with pytest.raises(TrainConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_config(cfg)


def test_bad_freeze_names_the_drafters_modules(tmp_path):
    cfg = config(tmp_path, train={"freeze": ["lm_heads"]})
    target = build_target(cfg)
    samples, _, _ = build_samples(cfg, target)
    drafter, _ = build_drafter(cfg, target, samples)
    _, params, _ = nnx.split(drafter, nnx.Param, ...)
    with pytest.raises(TrainConfigError, match=r"train.freeze has \['lm_heads'\].*lm_head"):
        trainable_mask(params, ["lm_heads"])
    everything = sorted({str(getattr(p[0], "key", p[0])) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]})
    with pytest.raises(TrainConfigError, match="nothing would train"):
        trainable_mask(params, everything)
