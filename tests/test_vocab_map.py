"""d2t / t2d from loss-masked token frequencies, and the eagle-jax-vocab-map CLI (eagle_jax.cli.vocab_map)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from eagle_jax.training.data import Sample, load_samples
from eagle_jax.training.vocab_map import build_vocab_map, coverage, load_vocab_map, save_vocab_map, token_counts
from workshop.tokenizer_build import train_tokenizer


def test_counts_only_loss_masked_positions():
    samples = [
        Sample(np.array([1, 2, 3, 3], np.int32), np.array([0, 1, 1, 1], np.uint8)),
        Sample(np.array([5, 1, 1], np.int32), np.array([1, 0, 1], np.uint8)),
    ]
    np.testing.assert_array_equal(token_counts(samples, 7), [0, 1, 1, 2, 0, 1, 0])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        token_counts(samples, 4)


def test_top_ids_sorted_offsets_and_mask():
    counts = np.array([5, 0, 9, 9, 1, 7, 0, 3])
    d2t, t2d = build_vocab_map(counts, 4)
    used = np.array([0, 2, 3, 5])  # the four most frequent, ascending
    np.testing.assert_array_equal(d2t, used - np.arange(4))
    assert d2t.dtype == np.int64 and t2d.dtype == bool
    np.testing.assert_array_equal(np.nonzero(t2d)[0], used)
    # Draft id i means target id i + d2t[i]; full logits gathered with t2d line up with draft ids.
    np.testing.assert_array_equal(np.arange(4) + d2t, np.arange(8)[t2d])
    # Ties go to the smaller id: counts 7 at ids 1 and 6, one slot left after id 0.
    d2t, _ = build_vocab_map(np.array([9, 7, 0, 0, 0, 0, 7]), 2)
    np.testing.assert_array_equal(np.arange(2) + d2t, [0, 1])
    assert coverage(counts, t2d) == pytest.approx(30 / 34)


def test_identity_when_draft_vocab_is_full():
    d2t, t2d = build_vocab_map(np.random.default_rng(0).integers(0, 5, 50), 50)
    assert not d2t.any() and t2d.all()
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_map(np.ones(5), 6)


def test_save_load_round_trip_and_validation(tmp_path):
    d2t, t2d = build_vocab_map(np.arange(20)[::-1], 6)
    path = tmp_path / "map.npz"
    save_vocab_map(path, d2t, t2d)
    assert path.exists()
    d2, t2 = load_vocab_map(path, 20, 6)
    np.testing.assert_array_equal(d2, d2t)
    np.testing.assert_array_equal(t2, t2d)
    with pytest.raises(ValueError, match="draft_vocab_size is 7"):
        load_vocab_map(path, 20, 7)
    bad = tmp_path / "bad.npz"
    save_vocab_map(bad, np.array([3, 2, 1]), np.zeros(20, bool))  # targets 3, 3, 3: not increasing
    with pytest.raises(ValueError, match="not strictly increasing"):
        load_vocab_map(bad, 20, 3)


def test_cli_builds_map_from_assistant_tokens(tmp_path):
    from eagle_jax.cli.vocab_map import main

    train_tokenizer(["hello world, the fox jumps over the lazy dog\n" * 20], vocab_size=300, out_dir=tmp_path / "tok")
    data = tmp_path / "chat.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "zzzz qqqq"}, {"role": "assistant", "content": "hello world"}]}
    ] * 3
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "vm.npz"
    main(["--data", str(data), "--tokenizer", str(tmp_path / "tok"), "--draft-vocab-size", "8", "--out", str(out)])
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    d2t, t2d = load_vocab_map(out, len(tok), 8)
    samples, _ = load_samples(data, tok, 512, progress=False)
    assistant = set(samples[0].input_ids[samples[0].loss_mask == 1].tolist())
    user_only = set(tok("zzzz qqqq")["input_ids"]) - assistant
    assert assistant <= set(np.nonzero(t2d)[0].tolist())  # every assistant token made it in
    assert not user_only & set(np.nonzero(t2d)[0].tolist())  # prompt-only tokens did not


def test_cli_reads_tokenizer_and_vocab_size_from_the_target(tmp_path, capsys):
    """``--target`` alone: its tokenizer, and its config's vocab_size (here larger than the tokenizer's, as in
    checkpoints with a padded embedding), read without weights (the directory has none)."""
    from eagle_jax import TargetConfig
    from eagle_jax.cli.vocab_map import main

    train_tokenizer(
        ["hello world, the fox jumps over the lazy dog\n" * 20], vocab_size=300, out_dir=tmp_path / "target"
    )
    v = len(AutoTokenizer.from_pretrained(tmp_path / "target")) + 5
    config = TargetConfig(
        "llama",
        vocab_size=v,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=64,
    )
    (tmp_path / "target" / "config.json").write_text(json.dumps(config.to_hf()))
    data = tmp_path / "chat.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "fox"}, {"role": "assistant", "content": "hello"}]}) + "\n"
    )
    main(
        [
            "--data",
            str(data),
            "--target",
            str(tmp_path / "target"),
            "--draft-vocab-size",
            "8",
            "--out",
            str(tmp_path / "vm.npz"),
        ]
    )
    assert f"kept 8 of {v} ids" in capsys.readouterr().out
    d2t, t2d = load_vocab_map(tmp_path / "vm.npz", v, 8)
    assert t2d.shape == (v,) and t2d.sum() == 8
    with pytest.raises(SystemExit):
        main(["--data", str(data), "--draft-vocab-size", "8", "--out", str(tmp_path / "other.npz")])  # neither given
