"""Target pretraining (how the bundled code model is made): it learns, resumes exactly where it stopped,
and ends with its long-context phase."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eagle_jax.config import RopeConfig, TargetConfig
from workshop.pretrain import PretrainConfig, pretrain

CONFIG = TargetConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope=RopeConfig(theta=10000.0),
    max_position_embeddings=64,
    tie_word_embeddings=True,
)


def _stream(n: int, seed: int) -> np.ndarray:
    """A learnable stream: a repeated random motif with noise."""
    rng = np.random.default_rng(seed)
    motif = rng.integers(0, 64, 13)
    s = np.tile(motif, n // 13 + 1)[:n]
    noise = rng.random(n) < 0.05
    s[noise] = rng.integers(0, 64, noise.sum())
    return s.astype(np.uint16)


def _params(target) -> list[np.ndarray]:
    from flax import nnx

    return [np.asarray(x) for x in __import__("jax").tree_util.tree_leaves(nnx.state(target, nnx.Param))]


def test_learns_and_resume_is_exact(tmp_path):
    stream, heldout = _stream(4000, 0), _stream(800, 0)
    cfg = PretrainConfig(steps=12, batch=4, seq_len=16, lr=1e-2, warmup=2, save_every=4, long_steps=4, long_seq_len=32)
    assert [cfg.shape_at(s) for s in (0, 7, 8, 11)] == [(4, 16), (4, 16), (2, 32), (2, 32)]
    full = pretrain(CONFIG, stream, heldout, cfg, tmp_path / "full")
    log = [json.loads(line) for line in open(tmp_path / "full/pretrain_log.jsonl")]
    assert [r["step"] for r in log] == [4, 8, 12]
    assert log[-1]["heldout_loss"] < log[0]["heldout_loss"] < np.log(64)
    assert log[-1]["seq_len"] == 32 and "heldout_loss_32" in log[-1]

    # A cut-off right after the step-8 save, then the same command again: the same weights at the end.
    class CutOff(Exception):
        pass

    def cut(ckpt):
        if json.loads((ckpt / "train_state.json").read_text())["step"] == 8:
            raise CutOff

    with pytest.raises(CutOff):
        pretrain(CONFIG, stream, heldout, cfg, tmp_path / "cut", on_save=cut)
    resumed = pretrain(CONFIG, stream, heldout, cfg, tmp_path / "cut")
    for a, b in zip(_params(full), _params(resumed)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_long_phase_must_fit(tmp_path):
    cfg = PretrainConfig(steps=4, batch=2, seq_len=16, long_steps=2, long_seq_len=128)
    with pytest.raises(ValueError, match="max_position_embeddings 64"):
        pretrain(CONFIG, _stream(2000, 1), _stream(400, 1), cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_continued_pretraining_starts_from_the_given_weights(tmp_path):
    """``init_from``: step 0 is the given model (its held-out loss, not a random model's), the optimiser is
    fresh, and a model of another shape is refused before anything is written."""
    stream, heldout = _stream(4000, 2), _stream(800, 2)
    base = pretrain(
        CONFIG,
        stream,
        heldout,
        PretrainConfig(steps=8, batch=4, seq_len=16, lr=1e-2, warmup=2, save_every=8),
        tmp_path / "base",
    )
    import jax.numpy as jnp

    from workshop.pretrain import lm_loss

    windows = jnp.asarray(np.stack([heldout[i : i + 17] for i in range(0, 320, 40)]).astype(np.int32))
    base_loss = float(lm_loss(base, windows))
    cont = pretrain(
        CONFIG,
        stream,
        heldout,
        PretrainConfig(steps=1, batch=4, seq_len=16, lr=1e-9, warmup=0, save_every=1),
        tmp_path / "cont",
        init_from=tmp_path / "base/ckpt",
    )
    assert abs(float(lm_loss(cont, windows)) - base_loss) < 1e-4 < np.log(64) - base_loss

    other = TargetConfig(**{**CONFIG.__dict__, "hidden_size": 48, "head_dim": 12})
    with pytest.raises(ValueError, match="parameter shapes differ"):
        pretrain(
            other,
            stream,
            heldout,
            PretrainConfig(steps=1, batch=2, seq_len=16),
            tmp_path / "bad",
            init_from=tmp_path / "base/ckpt",
        )
    assert not (tmp_path / "bad" / "ckpt").exists()
