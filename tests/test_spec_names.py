"""The EAGLE reference code's tree names (``total_token``, ``depth``, ``top_k`` of
``EaModel.from_pretrained``) as an input dialect of SpecConfig, and a check on the engine that they
mean what they mean there.

What the EAGLE code does with them (``Model.topK_genrate`` in ``eagle/model/cnets.py``): the drafter's
pass over the accepted tokens gives the root's ``top_k`` children (level 1), then ``for i in
range(depth)`` expands the ``top_k`` best frontier nodes, one level each (levels 2..depth+1); it keeps
the best ``total_token - 1`` drafted nodes (``Model.__init__`` stores ``total_tokens - 1``) and the
target verifies them with the root: ``total_token`` positions. A round accepts at most ``depth + 1``
drafts and emits ``accept_length + 1`` tokens (``update_inference_inputs``).
"""

from __future__ import annotations

import dataclasses

import pytest
from engine_models import markov_drafter, markov_target

import eagle_jax
import eagle_jax.decoding.engine as engine
from eagle_jax import ConfigError, SpecConfig
from eagle_jax.decoding import calls


def eagle_max_accept(depth: int) -> int:
    """Most drafts one EAGLE round accepts: levels 1 (root's top_k) + depth (expansion loop)."""
    return depth + 1


def eagle_verified_nodes(total_token: int) -> int:
    """Positions the EAGLE target verifies per round: the root plus total_token - 1 drafted nodes."""
    return total_token


# ------------------------------------------------------------------------------------- the mapping


@pytest.mark.parametrize(
    "names,expected",
    [
        ({"total_token": 60, "depth": 5, "top_k": 10}, (10, 6, 60)),
        ({"total_token": 60, "depth": 7, "top_k": 10}, (10, 8, 60)),  # EaModel.from_pretrained's defaults
        ({"total_token": 4, "depth": 0, "top_k": 3}, (3, 1, 4)),  # depth 0: the root's children only
        ({"total_token": 6, "depth": 4, "top_k": 1}, (1, 5, 6)),  # top_k 1: a chain of depth + 1 drafts
    ],
)
def test_eagle_names_map_to_tree_fields(names, expected):
    spec = SpecConfig.parse(names)
    assert spec.method == "tree"
    assert (spec.tree_top_k, spec.tree_depth, spec.tree_total_tokens) == expected
    assert spec.max_emitted == eagle_max_accept(names["depth"]) + 1
    assert spec.verify_width == eagle_verified_nodes(names["total_token"])
    assert SpecConfig.eagle_tree(**names) == spec
    assert SpecConfig.parse({"method": "tree", **names}) == spec


def test_a_one_wide_eagle_tree_has_the_shape_of_a_chain_of_depth_plus_one():
    """top_k=1, total_token=depth+2 keeps every candidate EAGLE scores (1 + depth): one path of
    depth + 1 drafts, which is vLLM's chain with num_speculative_tokens = depth + 1."""
    for depth in (0, 2, 5):
        tree = SpecConfig.eagle_tree(top_k=1, depth=depth, total_token=depth + 2)
        chain = SpecConfig.parse({"method": "eagle3", "num_speculative_tokens": depth + 1})
        assert (tree.verify_width, tree.max_emitted) == (chain.verify_width, chain.max_emitted)
        with pytest.raises(ConfigError, match=f"total_token={depth + 3}"):
            SpecConfig.eagle_tree(top_k=1, depth=depth, total_token=depth + 3)


def test_eagle_tree_defaults_are_eagles():
    assert SpecConfig.eagle_tree() == SpecConfig(method="tree", tree_top_k=10, tree_depth=8, tree_total_tokens=60)


def test_eagle_names_mix_with_our_names_for_other_quantities():
    spec = SpecConfig.parse({"depth": 2, "tree_top_k": 3, "tree_total_tokens": 12})
    assert (spec.method, spec.tree_top_k, spec.tree_depth, spec.tree_total_tokens) == ("tree", 3, 3, 12)
    # Not given in either dialect: this class's default (tree_top_k=8, tree_total_tokens=48).
    spec = SpecConfig.parse({"depth": 4})
    assert (spec.tree_top_k, spec.tree_depth, spec.tree_total_tokens) == (8, 5, 48)


def test_the_config_stays_one_frozen_set_of_fields():
    names = [f.name for f in dataclasses.fields(SpecConfig)]
    assert names == ["method", "num_speculative_tokens", "tree_top_k", "tree_depth", "tree_total_tokens"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        SpecConfig.eagle_tree().tree_depth = 3  # type: ignore[misc]


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "spec,eagle_name,our_name",
    [
        ({"depth": 5, "tree_depth": 6, "top_k": 10, "total_token": 60}, "depth", "tree_depth"),
        ({"total_token": 60, "tree_total_tokens": 60}, "total_token", "tree_total_tokens"),
        ({"top_k": 4, "tree_top_k": 4}, "top_k", "tree_top_k"),
    ],
)
def test_same_quantity_in_both_dialects_is_an_error(spec, eagle_name, our_name):
    with pytest.raises(ConfigError, match=f"'{eagle_name}' .*and '{our_name}' set the same quantity"):
        SpecConfig.parse(spec)


def test_auto_tuned_total_token_is_rejected():
    with pytest.raises(ConfigError, match=r"total_token=-1.*auto-tuning"):
        SpecConfig.parse({"total_token": -1, "depth": 5, "top_k": 10})
    with pytest.raises(ConfigError, match="total_token=-1"):
        SpecConfig.eagle_tree(total_token=-1)


@pytest.mark.parametrize(
    "spec,match",
    [
        ({"method": "chain", "depth": 3}, "method='chain'"),
        ({"method": "eagle3", "top_k": 3, "depth": 2, "total_token": 8}, "method='eagle3'"),
        ({"depth": -1, "top_k": 3, "total_token": 4}, "depth=-1"),
        ({"depth": 2.5, "top_k": 3, "total_token": 8}, "depth .*integer"),
        ({"depth": 2, "top_k": 3, "total_token": 8, "width": 2}, r"unknown fields \['width'\]"),
        # k + depth*k^2 = 2 + 2*4 = 10 drafted candidates at most, as in the EAGLE code: total_token <= 11.
        ({"depth": 2, "top_k": 2, "total_token": 12}, r"total_token=12.*tree_total_tokens=12 must be in 2\.\.11"),
        ({"depth": 2, "top_k": 0, "total_token": 8}, "top_k=0"),
    ],
)
def test_bad_eagle_names_raise_config_error(spec, match):
    with pytest.raises(ConfigError, match=match):
        SpecConfig.parse(spec)


def test_largest_eagle_tree_is_accepted():
    """total_token - 1 may use every candidate EAGLE scores: top_k + depth * top_k^2."""
    assert SpecConfig.parse({"depth": 2, "top_k": 2, "total_token": 11}).tree_total_tokens == 11


# ---------------------------------------------------------------------------- the engine agrees


DEPTH, TOP_K, TOTAL = 2, 3, 10
PROMPTS = [[3, 17, 9, 4, 22], [8, 1, 30, 12, 5, 19, 27, 2], [14, 6]]
MAX_NEW = 24


@pytest.fixture(scope="module")
def markov():
    """A near-bigram target and a drafter that agrees with it often (engine_models.py)."""
    target, succ = markov_target(vocab=32, hidden=64, seed=0, eps=0.1)
    drafter, _ = markov_drafter(target, succ, seed=0, disagree=0.15)
    return target, drafter


def test_a_round_emits_and_verifies_what_an_eagle_round_does(markov, monkeypatch):
    """generate with EAGLE's names: at most depth + 1 drafts accepted per round, and that many reached
    (tree_depth = depth would never accept depth + 1); the target verifies total_token tree nodes per
    round. (Greedy equality of trees with plain decoding is test_engine's; one program here.)"""
    target, drafter = markov
    seen = []

    def spy(keys, tree, logits, rs, shape):
        seen.append((tree.tokens.shape[1], logits.shape[1], shape))
        return accept_tree(keys, tree, logits, rs, shape)

    accept_tree = engine.accept_tree
    monkeypatch.setattr(engine, "accept_tree", spy)
    monkeypatch.setattr(calls, "PROGRAMS", calls.Programs())  # trace afresh, so that the spy runs
    spec = {"total_token": TOTAL, "depth": DEPTH, "top_k": TOP_K}
    res = eagle_jax.generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, spec=spec, eos_token_id=[])

    assert seen, "the tree round was not traced"
    for nodes, verified, shape in seen:
        assert nodes == verified == eagle_verified_nodes(TOTAL)
        assert (shape.top_k, shape.total_tokens) == (TOP_K, TOTAL)
    flat = [a for row in res.accepted for a in row if a >= 0]
    assert max(flat) == eagle_max_accept(DEPTH), flat  # reached, never exceeded
    assert min(flat) < eagle_max_accept(DEPTH)
    # Every row: one token from the prefill, then accepted + 1 per round.
    for row, acc in zip(res.tokens, res.accepted):
        assert len(row) <= 1 + sum(a + 1 for a in acc if a >= 0)
