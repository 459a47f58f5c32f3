"""API defaults a new user relies on: the model's own EOS, and load-time overrides of drafter config fields."""

from __future__ import annotations

import json

import pytest
from engine_models import random_pair

import eagle_jax
from eagle_jax import ConfigError, SpecConfig
from eagle_jax.config import default_aux_layer_ids

MAX_NEW = 12


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    """A random pair saved as checkpoints, and the plain greedy continuation of one prompt."""
    root = tmp_path_factory.mktemp("api_defaults")
    target, drafter = random_pair(vocab=48, hidden=32, logit_scale=4.0, layers=4)
    eagle_jax.save_target(target, root / "target")
    eagle_jax.save_drafter(drafter, root / "drafter")
    plain = eagle_jax.generate(target, None, [[1, 2, 3]], max_new_tokens=MAX_NEW).tokens[0]
    return root, plain


def _eos_at(plain: list[int], index: int = 4) -> int:
    """A token whose first occurrence in the plain output is at ``index`` or later."""
    for i in range(index, len(plain)):
        if plain[i] not in plain[:i]:
            return plain[i]
    pytest.skip("the plain output repeats itself too early to pick an EOS")


def _write(path, name, value) -> None:
    (path / name).write_text(json.dumps(value))


def test_eos_from_config_json(saved_pair):
    root, plain = saved_pair
    eos = _eos_at(plain)
    cfg = json.loads((root / "target" / "config.json").read_text())
    _write(root / "target", "config.json", {**cfg, "eos_token_id": eos})
    target = eagle_jax.load_target(root / "target")
    drafter = eagle_jax.load_drafter(root / "drafter", target)
    cut = plain[: plain.index(eos) + 1]
    chain = SpecConfig(num_speculative_tokens=3)  # (spec="auto", the default, is tests/test_chooser.py's)
    for d in (None, drafter):
        assert eagle_jax.generate(target, d, [[1, 2, 3]], max_new_tokens=MAX_NEW, spec=chain).tokens[0] == cut
        # An explicit empty list turns stopping off.
        assert (
            eagle_jax.generate(target, d, [[1, 2, 3]], max_new_tokens=MAX_NEW, spec=chain, eos_token_id=[]).tokens[0]
            == plain
        )
    chunks = list(
        eagle_jax.generate_stream(target, drafter, [[1, 2, 3]], max_new_tokens=MAX_NEW, rounds_per_chunk=2, spec=chain)
    )
    assert [t for c in chunks for t in c[0]] == cut


def test_eos_list_from_generation_config(saved_pair):
    """generation_config.json wins over config.json (as in HF generate), lists of ids included."""
    root, plain = saved_pair
    eos = _eos_at(plain)
    cfg = json.loads((root / "target" / "config.json").read_text())
    _write(root / "target", "config.json", {**cfg, "eos_token_id": None})
    _write(root / "target", "generation_config.json", {"eos_token_id": [47, eos]})
    target = eagle_jax.load_target(root / "target")
    assert target.config.eos_token_id == (47, eos)
    assert (
        eagle_jax.generate(target, None, [[1, 2, 3]], max_new_tokens=MAX_NEW).tokens[0] == plain[: plain.index(eos) + 1]
    )
    (root / "target" / "generation_config.json").unlink()


def test_drafter_overrides(saved_pair):
    root, _ = saved_pair
    target = eagle_jax.load_target(root / "target")
    base = eagle_jax.load_drafter(root / "drafter", target)
    assert not base.config.norm_output
    flipped = eagle_jax.load_drafter(root / "drafter", target, overrides={"norm_output": True})
    assert flipped.config.norm_output and flipped.config.fc_norm == base.config.fc_norm
    moved = eagle_jax.load_drafter(root / "drafter", target, overrides={"aux_layer_ids": [0, 1, 2]})
    assert moved.config.aux_layer_ids == (0, 1, 2) and base.config.aux_layer_ids == default_aux_layer_ids(4)
    out = eagle_jax.generate(
        target, moved, [[1, 2, 3]], max_new_tokens=4, eos_token_id=[], spec=SpecConfig(num_speculative_tokens=3)
    )
    assert len(out.tokens[0]) == 4
    with pytest.raises(ConfigError, match=r"overrides \['hidden_size'\] are not overridable"):
        eagle_jax.load_drafter(root / "drafter", target, overrides={"hidden_size": 64})
    with pytest.raises(ConfigError, match="has 2 ids but the checkpoint's fc reads 3 aux states"):
        eagle_jax.load_drafter(root / "drafter", target, overrides={"aux_layer_ids": [0, 1]})
    with pytest.raises(ConfigError, match="out of range for a target with 4 layers"):
        eagle_jax.load_drafter(root / "drafter", target, overrides={"aux_layer_ids": [0, 1, 7]})
    with pytest.raises(ConfigError, match="mutually exclusive"):
        eagle_jax.load_drafter(root / "drafter", target, overrides={"fc_norm": True, "norm_before_fc": True})


def test_one_pair_check_for_loading_and_generating(saved_pair):
    """The same check (``eagle_jax.config.check_pair``) guards load_drafter, generate and the slot engine."""
    from engine_models import drafter_config

    import eagle_jax.checkpoint.eagle_drafter as loader
    import eagle_jax.generate as gen
    from eagle_jax.config import check_pair
    from eagle_jax.serving import SlotEngine

    root, _ = saved_pair
    assert not hasattr(gen, "check_pair") or gen.check_pair is check_pair
    assert not hasattr(loader, "check_pair") or loader.check_pair is check_pair
    target = eagle_jax.load_target(root / "target")
    wrong = drafter_config(target.config).replace(num_aux_hidden_states=2)
    with pytest.raises(ConfigError) as direct:
        check_pair(target.config, wrong)
    from flax import nnx

    abstract = nnx.eval_shape(lambda: eagle_jax.Drafter(wrong))
    for call in (
        lambda: eagle_jax.generate(target, abstract, [[1, 2]], max_new_tokens=2),
        lambda: SlotEngine(target, abstract, slots=1, max_len=16),
    ):
        with pytest.raises(ConfigError) as err:
            call()
        assert str(err.value) == str(direct.value)
    cfg = json.loads((root / "drafter" / "config.json").read_text())
    bad = root / "drafter_bad"
    bad.mkdir(exist_ok=True)
    for f in (root / "drafter").iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg.pop("eagle_config", None)
    _write(bad, "config.json", {**cfg, "num_aux_hidden_states": 2})
    with pytest.raises(ConfigError, match="num_aux_hidden_states=2 but it reads 3 target layers"):
        eagle_jax.load_drafter(bad, target)
