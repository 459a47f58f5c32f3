"""End-to-end TTT training on a tiny random target: learning, resume, sharding, multi-process, export.

All runs share one config (constant learning rate after a 5-step warmup, so a run stopped after N
steps follows the same schedule as the long one) and are compared step by step with the reference
run: one process, one CPU device.

Tolerances: a resumed run repeats the same programs on the same inputs, so its losses must agree to
1e-6 relative (observed: bitwise equal). Sharded runs (8 host devices; 2 processes) sum
the same numbers in a different order (partial sums per shard + all-reduce), which moves fp32 losses
by ~1e-7 relative per step; we allow 2e-5 over 20 steps, and 1e-4 absolute on the exported weights
(O(0.1-1)), far below the O(1e-2) effect of a single lost or doubled gradient step at lr 3e-3.
Gradient accumulation (2 x 8 vs 16) is held to the same 2e-5; bf16 compute to 5e-3 (observed 5e-4).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from host_devices import env_with_devices
from safetensors.numpy import load_file

from eagle_jax import load_drafter
from eagle_jax.config import default_aux_layer_ids
from eagle_jax.training.trainer import build_target, export_checkpoint, load_config, train

REPO = Path(__file__).resolve().parents[1]
SHORT = 20  # steps of the sharded / multi-process runs

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
    "drafter": {"draft_vocab_size": 128, "norm_output": True, "fc_norm": True},
    "data": {"synthetic": {"num_samples": 256, "prompt_length": 4}, "max_length": 32},
    "train": {"steps": 120, "batch_size": 16, "lr": 3e-3, "warmup_steps": 5, "min_lr_ratio": 1.0, "ttt_length": 3},
    "checkpoint": {"every": 20, "keep": 10},
    "log": {"every": 1, "progress": False},
}


def write_config(path: Path) -> Path:
    path.write_text(yaml.safe_dump(CONFIG))
    return path


def losses_of(run_dir: Path) -> np.ndarray:
    recs = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, len(recs) + 1)), "one record per step, no gaps or repeats"
    return np.array([r["loss"] for r in recs])


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A persistent compilation cache: repeated runs of the same program skip XLA compilation."""
    d = tmp_path_factory.mktemp("jax_cache")
    old = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_compilation_cache_dir", str(d))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    yield d
    jax.config.update("jax_compilation_cache_dir", old[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("training")


@pytest.fixture(scope="module")
def reference(work, cache_dir):
    cfg_path = write_config(work / "config.yaml")
    cfg = load_config(cfg_path, [f"run_dir={work / 'ref'}"])
    summary = train(cfg)
    return {
        "cfg_path": cfg_path,
        "cfg": cfg,
        "summary": summary,
        "run_dir": work / "ref",
        "losses": losses_of(work / "ref"),
    }


def test_training_learns_the_targets_continuations(reference):
    recs = reference["summary"]["records"]
    assert len(recs) == 120
    acc0 = np.mean([r["acc_per_position"][0] for r in recs[-10:]])
    chance = 1 / 128
    assert acc0 > 0.15, f"step-0 accuracy {acc0:.3f} after 120 steps (chance {chance:.4f})"
    first, last = np.mean(reference["losses"][:5]), np.mean(reference["losses"][-10:])
    assert last < 0.85 * first
    assert recs[-1]["simulated_al"] > 1.15
    r = recs[-1]
    assert len(r["loss_per_position"]) == len(r["acc_per_position"]) == 3
    assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1.5 and r["lr"] == pytest.approx(3e-3)


def test_kill_and_resume_continues_the_same_loss_curve(reference, work, cache_dir):
    run = work / "resumed"
    cfg = load_config(reference["cfg_path"], [f"run_dir={run}"])
    first = train(cfg, stop_after=45)
    assert first["step"] == 45 and "export_dir" not in first
    # Killed after logging step 45 but before its checkpoint landed: the last checkpoint is step 40.
    shutil.rmtree(run / "checkpoints" / "45")
    second = train(cfg, stop_after=60)
    assert second["records"][0]["step"] == 41  # steps 41-45 redone, their old records replaced
    losses = losses_of(work / "resumed")
    assert len(losses) == 60
    np.testing.assert_allclose(losses, reference["losses"][:60], rtol=1e-6, atol=0)


def test_gradient_accumulation_matches_the_full_batch(reference, work, cache_dir):
    """2 micro-batches of 8 = one batch of 16: with "all" normalisation each micro-loss is a mean over
    equal-sized micro-batches, so the averaged gradient is the full-batch gradient up to fp32 rounding."""
    cfg = load_config(reference["cfg_path"], [f"run_dir={work / 'accum'}", "train.grad_accum=2", "checkpoint.every=0"])
    train(cfg, stop_after=10)
    np.testing.assert_allclose(losses_of(work / "accum"), reference["losses"][:10], rtol=2e-5)


def test_bf16_compute_tracks_fp32(reference, work, cache_dir):
    """bf16 forward/backward over fp32 master weights: the same curve to bf16 precision (observed 5e-4 relative)."""
    cfg = load_config(
        reference["cfg_path"], [f"run_dir={work / 'bf16'}", "train.compute_dtype=bfloat16", "checkpoint.every=0"]
    )
    train(cfg, stop_after=10)
    losses = losses_of(work / "bf16")
    np.testing.assert_allclose(losses, reference["losses"][:10], rtol=5e-3)
    assert not np.array_equal(losses, reference["losses"][:10])  # it did run in bf16


def _reference_weights_at(reference, step: int, out: Path) -> dict[str, np.ndarray]:
    export_checkpoint(reference["run_dir"] / "checkpoints" / str(step), out)
    return load_file(out / "model.safetensors")


def _compare_weights(got_dir: Path, want: dict[str, np.ndarray]) -> None:
    got = load_file(got_dir / "model.safetensors")
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-4, err_msg=k)


def test_eight_devices_match_one_device(reference, work):
    run = work / "eight"
    cmd = [
        sys.executable,
        "-m",
        "train.ttt",
        "--config",
        str(reference["cfg_path"]),
        "--set",
        f"run_dir={run}",
        "--set",
        f"train.steps={SHORT}",
        "--set",
        "mesh={data: 2, fsdp: 2, model: 2}",
    ]
    p = subprocess.run(cmd, cwd=REPO, env=env_with_devices(8, str(REPO)), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "mesh {'data': 2, 'fsdp': 2, 'model': 2}" in p.stdout
    np.testing.assert_allclose(losses_of(run), reference["losses"][:SHORT], rtol=2e-5)
    _compare_weights(run / "export", _reference_weights_at(reference, SHORT, work / "ref_export_20"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_process(reference, work):
    """jax.distributed over CPU (gloo collectives), 2 processes x 1 device, parameters sharded (fsdp) across them."""
    run = work / "two_proc"
    port = _free_port()
    procs = []
    for pid in range(2):
        cmd = [
            sys.executable,
            "-m",
            "train.ttt",
            "--config",
            str(reference["cfg_path"]),
            "--set",
            f"run_dir={run}",
            "--set",
            f"train.steps={SHORT}",
            "--set",
            "mesh={data: 1, fsdp: 2, model: 1}",
            "--set",
            f"distributed={{coordinator: '127.0.0.1:{port}', num_processes: 2, process_id: {pid}}}",
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env_with_devices(1, str(REPO)),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert "mesh {'data': 1, 'fsdp': 2, 'model': 1}" in outs[0][0]
    np.testing.assert_allclose(losses_of(run), reference["losses"][:SHORT], rtol=2e-5)
    _compare_weights(run / "export", _reference_weights_at(reference, SHORT, work / "ref_export_20b"))


def test_export_round_trip(reference, work):
    run_dir = reference["run_dir"]
    export = Path(reference["summary"]["export_dir"])
    # The end-of-run export and `train.export` from the last checkpoint write the same tensors.
    from eagle_jax.cli.export import main as export_main

    export_main(["--checkpoint", str(run_dir), "--out", str(work / "cli_export")])
    a, b = load_file(export / "model.safetensors"), load_file(work / "cli_export" / "model.safetensors")
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
    assert "embed_tokens.weight" not in a and a["d2t"].dtype == np.int64 and a["t2d"].dtype == bool
    hf = json.loads((export / "config.json").read_text())
    assert hf["fc_norm"] and hf["norm_output"] and hf["draft_vocab_size"] == 128

    target = build_target(reference["cfg"])
    drafter = load_drafter(export, target)
    assert drafter.config.aux_layer_ids == default_aux_layer_ids(target.config.num_layers)
    # The loaded module holds the exported tensors (kernels transposed back) and runs.
    np.testing.assert_array_equal(np.asarray(drafter.fc.kernel[...]).T, a["fc.weight"])
    np.testing.assert_array_equal(np.asarray(drafter.d2t[...]), a["d2t"])
    ids = np.arange(12, dtype=np.int32)[None] % 256
    _, aux = target(ids, drafter.config.aux_layer_ids)
    logits, _ = drafter(aux, ids)
    assert logits.shape == (1, 12, 128) and np.isfinite(np.asarray(logits)).all()
