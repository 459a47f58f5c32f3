"""Training data: chat / ShareGPT / text records, loss masks, length filtering, batching, resumable order."""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from eagle_jax.training.data import (
    Batcher,
    DataError,
    DataPosition,
    Sample,
    check_chat_template,
    default_buckets,
    encode_record,
    load_samples,
)
from workshop.tokenizer_build import train_tokenizer

CORPUS = [
    "def add(a, b):\n    return a + b\n" * 10,
    "The quick brown fox jumps over the lazy dog. Hello there, how are you?\n" * 10,
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n" * 10,
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(CORPUS, vocab_size=400, out_dir=out)
    return AutoTokenizer.from_pretrained(out)


CHAT = [
    {"role": "system", "content": "You write code."},
    {"role": "user", "content": "Add two numbers."},
    {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
    {"role": "user", "content": "Thanks, how are you?"},
    {"role": "assistant", "content": "Hello there."},
]


def test_chat_loss_mask_is_exactly_the_assistant_tokens(tokenizer):
    s = encode_record({"messages": CHAT}, tokenizer)
    assert s.input_ids.dtype == np.int32 and s.input_ids.shape == s.loss_mask.shape
    assert tokenizer.decode(s.input_ids) == tokenizer.apply_chat_template(CHAT, tokenize=False)
    # The masked tokens are the assistant contents (with the template's closing <|end|>), nothing else.
    runs, cur = [], []
    for tok, m in zip(s.input_ids, s.loss_mask):
        if m:
            cur.append(int(tok))
        elif cur:
            runs.append(cur)
            cur = []
    assert [tokenizer.decode(r) for r in runs] == [CHAT[2]["content"] + "<|end|>", CHAT[4]["content"] + "<|end|>"]
    unmasked = tokenizer.decode(s.input_ids[s.loss_mask == 0])
    assert "Add two numbers." in unmasked and "You write code." in unmasked and "def add" not in unmasked


def test_sharegpt_renders_like_messages(tokenizer):
    role = {"system": "system", "user": "human", "assistant": "gpt"}
    conv = [{"from": role[m["role"]], "value": m["content"]} for m in CHAT]
    a = encode_record({"messages": CHAT}, tokenizer)
    b = encode_record({"conversations": conv}, tokenizer)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    with pytest.raises(DataError, match="ShareGPT turn needs 'from'"):
        encode_record({"conversations": [{"from": "narrator", "value": "x"}]}, tokenizer, "f.jsonl:3")


def test_text_with_prompt_prefix(tokenizer):
    s = encode_record({"prompt": "def add(a, b):\n", "text": "    return a + b\n"}, tokenizer)
    n_prompt = len(tokenizer("def add(a, b):\n")["input_ids"])
    assert s.loss_mask[:n_prompt].sum() == 0 and s.loss_mask[n_prompt:].all()
    assert tokenizer.decode(s.input_ids[n_prompt:]) == "    return a + b\n"
    plain = encode_record({"text": "hello there"}, tokenizer)
    assert plain.loss_mask.all()


def test_template_without_generation_markers_masks_by_prefix_diffing(tokenizer, tmp_path):
    check_chat_template(tokenizer)
    saved = tokenizer.chat_template
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n")
    try:
        # No markers and no end-of-turn token: each assistant span (reply and newline) is found by diffing renderings.
        tokenizer.chat_template = (
            "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
        )
        samples, stats = load_samples(path, tokenizer, 512, progress=False)
        s = samples[0]
        assert stats.kept == 1 and tokenizer.decode(s.input_ids) == tokenizer.apply_chat_template(CHAT, tokenize=False)
        # The replies' first tokens (" def", " Hello") straddle "assistant: " and the reply: masked, as with markers.
        assert (
            tokenizer.decode(s.input_ids[s.loss_mask == 1])
            == " " + CHAT[2]["content"] + "\n " + CHAT[4]["content"] + "\n"
        )
        tokenizer.chat_template = None
        with pytest.raises(DataError, match="has no chat_template"):
            load_samples(path, tokenizer, 512, progress=False)
    finally:
        tokenizer.chat_template = saved


def test_load_samples_drops_and_counts(tokenizer, tmp_path):
    path = tmp_path / "mixed.jsonl"
    long_chat = CHAT[:2] + [{"role": "assistant", "content": "word " * 200}]
    lines = [
        {"messages": CHAT},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Hello there."}]},
        {"text": "the quick brown fox"},
        {"messages": long_chat},  # too long
        {"messages": CHAT[:2]},  # no assistant turn: nothing to learn
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    samples, stats = load_samples(path, tokenizer, max_length=96, progress=False)
    assert (stats.records, stats.kept, stats.too_long, stats.no_loss) == (5, 3, 1, 1)
    assert stats.tokens == sum(len(s) for s in samples)
    assert stats.loss_tokens == sum(int(s.loss_mask.sum()) for s in samples)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n{not json\n")
    with pytest.raises(DataError, match="bad.jsonl:2: not valid JSON"):
        load_samples(bad, tokenizer, 96, progress=False)
    with pytest.raises(DataError, match="needs 'messages', 'conversations' or 'text'"):
        encode_record({"prompt": "x"}, tokenizer, "f.jsonl:1")


def _samples(n: int, max_len: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(4, max_len + 1))
        ids = np.full(length, i + 10, np.int32)  # every token names its sample
        mask = (rng.random(length) < 0.7).astype(np.uint8)
        out.append(Sample(ids, mask))
    return out


def test_pad_batching_shapes_and_epoch_order():
    samples = _samples(50, 32)
    b = Batcher(samples, batch_size=8, max_length=32, seed=3, pad_id=1)
    assert b.batches_per_epoch == 6
    seen = []
    for k in range(6):
        batch = b.batch(DataPosition(0, k))
        assert batch["input_ids"].shape == (8, 32) and batch["loss_mask"].shape == (8, 32)
        for row, mask in zip(batch["input_ids"], batch["loss_mask"]):
            i = int(row[0]) - 10
            n = len(samples[i])
            np.testing.assert_array_equal(row[:n], samples[i].input_ids)
            np.testing.assert_array_equal(mask[:n], samples[i].loss_mask)
            assert (row[n:] == 1).all() and (mask[n:] == 0).all()  # padding is never trained on
            seen.append(i)
    assert len(set(seen)) == 48  # each sample at most once per epoch
    first = [b.batch(DataPosition(0, k))["input_ids"][:, 0].tolist() for k in range(6)]
    again = Batcher(samples, batch_size=8, max_length=32, seed=3, pad_id=1)
    assert first == [again.batch(DataPosition(0, k))["input_ids"][:, 0].tolist() for k in range(6)]
    assert first != [b.batch(DataPosition(1, k))["input_ids"][:, 0].tolist() for k in range(6)]
    other_seed = Batcher(samples, batch_size=8, max_length=32, seed=4, pad_id=1)
    assert first != [other_seed.batch(DataPosition(0, k))["input_ids"][:, 0].tolist() for k in range(6)]


def test_bucket_batching():
    samples = _samples(200, 64)
    assert default_buckets(64) == (16, 32, 64) and default_buckets(2048) == (256, 512, 1024, 2048)
    b = Batcher(samples, batch_size=4, max_length=64, mode="bucket", buckets=(16, 32, 64), seed=0)
    lengths = set()
    total = 0
    for k in range(b.batches_per_epoch):
        batch = b.batch(DataPosition(2, k))
        length = batch["input_ids"].shape[1]
        lengths.add(length)
        for row in batch["input_ids"]:
            n = len(samples[int(row[0]) - 10])
            assert n <= length and (length == 16 or n > length // 2)  # smallest bucket that holds it
        total += len(batch["input_ids"])
    assert lengths == {16, 32, 64}
    assert total > 200 - 3 * 4  # at most one incomplete batch dropped per bucket


def test_resume_from_position_continues_the_same_stream():
    samples = _samples(30, 16)
    b = Batcher(samples, batch_size=4, max_length=16, seed=1)
    stream = b.iterate()
    full = [next(stream) for _ in range(20)]  # crosses two epoch boundaries (7 batches per epoch)
    assert full[7][0] == DataPosition(1, 0)
    pos = full[11][0]
    resumed = Batcher(samples, batch_size=4, max_length=16, seed=1).iterate(pos)
    for p, batch in full[11:]:
        q, batch2 = next(resumed)
        assert p == q
        np.testing.assert_array_equal(batch["input_ids"], batch2["input_ids"])
    assert DataPosition.from_dict(pos.to_dict()) == pos


def test_batcher_errors():
    with pytest.raises(DataError, match="do not fill one batch"):
        Batcher(_samples(3, 8), batch_size=4, max_length=8)
    with pytest.raises(DataError, match="> max_length"):
        Batcher(_samples(8, 16), batch_size=2, max_length=4)
    with pytest.raises(DataError, match="'pad' or 'bucket'"):
        Batcher(_samples(8, 8), batch_size=2, max_length=8, mode="sorted")
    with pytest.raises(DataError, match="buckets \\[4, 8\\] are for batching mode 'bucket'; mode 'pack'"):
        Batcher(_samples(8, 8), batch_size=2, max_length=8, mode="pack", buckets=(4, 8))


def test_greedy_samples_are_the_targets_own_continuations():
    import jax.numpy as jnp

    from eagle_jax import Target, TargetConfig
    from eagle_jax.training.data import greedy_samples

    cfg = TargetConfig(
        "llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    target = Target(cfg)
    samples = greedy_samples(target, num_samples=5, prompt_length=3, length=10, seed=0, batch_size=4)
    assert len(samples) == 5 and all(len(s) == 10 for s in samples)
    s = samples[4]
    np.testing.assert_array_equal(s.loss_mask, [0, 0, 0] + [1] * 7)
    logits, _ = target(jnp.asarray(s.input_ids[None]))
    np.testing.assert_array_equal(np.argmax(np.asarray(logits[0, 2:-1]), -1), s.input_ids[3:])


def test_long_context_stitching():
    """Conversations chained until a drawn length: each record within bounds, every turn of the inputs
    used at most once and in its order, system messages only at the start."""
    from eagle_jax.training.long_context import stitch

    convs = [
        [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": f"q{i}"},
            {"role": "assistant", "content": f"a{i}"},
        ]
        for i in range(40)
    ]
    lengths = [100 + 10 * (i % 7) for i in range(40)]
    out = stitch(convs, lengths, count=10, min_tokens=300, max_tokens=500, seed=1)
    assert 5 <= len(out) <= 10
    seen = []
    for r in out:
        msgs = r["messages"]
        assert msgs[0]["role"] == "system" and all(m["role"] != "system" for m in msgs[1:])
        ids = [int(m["content"][1:]) for m in msgs if m["role"] == "user"]
        assert [m["content"] for m in msgs if m["role"] == "assistant"] == [f"a{i}" for i in ids]
        assert 300 <= sum(lengths[i] for i in ids) <= 500
        seen += ids
    assert len(seen) == len(set(seen))
    with pytest.raises(DataError, match="min_tokens"):
        stitch(convs, lengths, count=1, min_tokens=0, max_tokens=5)
