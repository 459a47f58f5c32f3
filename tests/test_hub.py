"""Hub repo ids in ``load_target``: resolved through a Hugging Face cache laid out as huggingface_hub
writes it (``models--org--name/refs/<rev>`` -> ``snapshots/<commit>/``), offline, with no network."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import eagle_jax
from eagle_jax import CheckpointError, Target, TargetConfig
from eagle_jax.checkpoint.hub import looks_like_repo_id, resolve_checkpoint

MAIN, OTHER = "a" * 40, "b" * 40


def tiny_target(seed: int, layers: int) -> Target:
    config = TargetConfig(
        architecture="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    return Target(config, rngs=nnx.Rngs(seed))


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A cache holding org/name at two commits ('main' -> 2 layers, 'v2' -> 3 layers), offline."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hf" / "hub"
    repo = cache / "models--org--name"
    for commit, layers, ref in ((MAIN, 2, "main"), (OTHER, 3, "v2")):
        eagle_jax.save_target(tiny_target(layers, layers), repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads these at import time; the fetch reads the module constants.
    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # no local 'org/name' directory shadows the id
    return repo


def test_load_target_from_cached_hub_id(hub_cache):
    target = eagle_jax.load_target("org/name", dtype="float32")
    assert target.config.num_layers == 2
    expected = eagle_jax.load_target(hub_cache / "snapshots" / MAIN, dtype="float32")
    ids = np.arange(8, dtype=np.int32)[None]
    np.testing.assert_array_equal(np.asarray(target(ids)[0]), np.asarray(expected(ids)[0]))


def test_revision_picks_another_snapshot(hub_cache):
    assert eagle_jax.load_target("org/name", revision="v2").config.num_layers == 3
    assert eagle_jax.load_target("org/name", revision=OTHER).config.num_layers == 3  # a commit hash
    assert resolve_checkpoint("org/name", revision="v2") == hub_cache / "snapshots" / OTHER


def test_uncached_id_offline_is_a_clear_error(hub_cache):
    with pytest.raises(CheckpointError, match=r"'org/missing' is not in the Hugging Face cache .*HF_HUB_OFFLINE"):
        eagle_jax.load_target("org/missing")
    with pytest.raises(CheckpointError, match=r"'org/name' at revision 'nope' is not in the Hugging Face cache"):
        eagle_jax.load_target("org/name", revision="nope")


def test_local_paths(tmp_path, hub_cache):
    snapshot = hub_cache / "snapshots" / MAIN
    assert resolve_checkpoint(snapshot) == snapshot and resolve_checkpoint(str(snapshot)) == snapshot
    for missing in ("./nope", "/no/such/dir", "~/no-such-checkpoint-dir", "runs/a/b", tmp_path / "nope"):
        with pytest.raises(CheckpointError, match="no such checkpoint directory"):
            eagle_jax.load_target(missing)
    with pytest.raises(CheckpointError, match="revisions apply to Hub repo ids only"):
        resolve_checkpoint(snapshot, revision="main")
    assert looks_like_repo_id("meta-llama/Llama-3.1-8B-Instruct") and looks_like_repo_id("gpt2")
    assert not any(map(looks_like_repo_id, ("a/b/c", "./x", "-x", "a--b", "org/", "")))
