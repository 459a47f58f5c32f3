"""Regeneration: assistant turns replaced by (or appended as) the target's own greedy replies, turn by turn;
prompts synthesised from the target itself (Magpie)."""

from __future__ import annotations

import json
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import AutoTokenizer

from eagle_jax import Target, TargetConfig, save_target
from eagle_jax.training.chat import pre_query
from eagle_jax.training.data import load_samples
from workshop.tokenizer_build import train_tokenizer

CORPUS = ["def add(a, b):\n    return a + b\n" * 10, "Hello there, how are you? Fine, thanks.\n" * 10]


_FORWARDS: dict[int, object] = {}


def forward_of(target: Target):
    """The target's logits function, jitted once per target (every reference decoding reuses its program)."""
    if id(target) not in _FORWARDS:
        _FORWARDS[id(target)] = jax.jit(lambda x: target(x)[0])
    return _FORWARDS[id(target)]


def greedy(target: Target, ids: list[int], n: int, eos: int, width: int = 128) -> list[int]:
    """Reference: the target's own greedy decoding by full (causal, right-padded) forwards, stopping after EOS."""
    forward = forward_of(target)
    out = list(ids)
    for _ in range(n):
        logits = forward(jnp.asarray([out + [0] * (width - len(out))], jnp.int32))
        out.append(int(np.argmax(np.asarray(logits[0, len(out) - 1]))))
        if out[-1] == eos:
            break
    return out[len(ids) :]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(checkpoint directory with its tokenizer, tokenizer, target): one tiny target shared by the tests so
    that they reuse its compiled programs."""
    path = tmp_path_factory.mktemp("target")
    train_tokenizer(CORPUS, vocab_size=300, out_dir=path)
    tok = AutoTokenizer.from_pretrained(path)
    cfg = TargetConfig(
        "llama",
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    )
    target = Target(cfg)
    kernel = target.lm_head.kernel[...] * 8.0  # peaked, varied replies
    target.lm_head.kernel.set_value(kernel)
    # So that sampled user turns end: EOS gets the output weights of a token the model often writes after the user
    # header (the runner-up of a few sampled turns), so it is about as likely as that token wherever that one is.
    rng, written = np.random.default_rng(0), Counter()
    for system in (None, None, "be brief", "be brief"):
        ids = tok(pre_query(tok, system), add_special_tokens=False)["input_ids"]
        for _ in range(12):
            logits = np.asarray(
                forward_of(target)(jnp.asarray([ids + [0] * (128 - len(ids))], jnp.int32))[0, len(ids) - 1]
            )
            p = np.exp(logits - logits.max())
            ids.append(int(rng.choice(len(p), p=p / p.sum())))
            written[ids[-1]] += 1
    target.lm_head.kernel.set_value(kernel.at[:, tok.eos_token_id].set(kernel[:, written.most_common(2)[1][0]]))
    save_target(target, path)
    return path, tok, target


def read_out(path) -> list[list[dict[str, str]]]:
    return [json.loads(line)["messages"] for line in path.read_text().splitlines()]


def assert_greedy_replies(conv: list[dict[str, str]], tok, target: Target, n: int) -> None:
    """Each reply is the target's greedy continuation of the conversation so far (earlier replies its own)."""
    for i, m in enumerate(conv):
        if m["role"] != "assistant":
            continue
        prompt = tok.apply_chat_template(conv[:i], tokenize=True, add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
        want = tok.decode(greedy(target, list(prompt), n, tok.eos_token_id), skip_special_tokens=True)
        assert m["content"] == want and "OLD" not in m["content"]


def test_the_reply_writer_batches_continuously_with_each_prompts_own_result(pair):
    """More prompts than slots, of varied lengths: each greedy reply is the target's own greedy decoding, and each
    sampled reply depends on its prompt's seed only, not on how many slots share the work."""
    from eagle_jax.training.replies import ReplyWriter

    _, tok, target = pair
    prompts = [tok.encode(t) for t in ("hello", "def add(a, b):", "Hello there, how are you?", "hi", "def", "Fine")]
    with ReplyWriter(target, None, slots=2, eos_ids=[tok.eos_token_id]) as two:
        greedy_replies = two.write(prompts, max_new_tokens=7)
        sampled = two.write(prompts, max_new_tokens=7, temperature=1.0, seed=5)
    assert greedy_replies == [greedy(target, p, 7, tok.eos_token_id) for p in prompts]
    with ReplyWriter(target, None, slots=3, eos_ids=[tok.eos_token_id]) as three:
        assert three.write(prompts, max_new_tokens=7, temperature=1.0, seed=5) == sampled
        assert three.write(prompts[2:], max_new_tokens=7, temperature=1.0, seed=7) == sampled[2:]
    assert sampled != greedy_replies


def test_a_bad_prompt_stops_the_call_with_a_clear_error_and_the_writer_goes_on(pair):
    from eagle_jax.config import ConfigError
    from eagle_jax.training.replies import ReplyWriter

    _, tok, target = pair
    good = tok.encode("hello")
    with ReplyWriter(target, None, slots=2, eos_ids=[tok.eos_token_id]) as writer:
        with pytest.raises(ConfigError, match=r"prompt token ids \[99999\] are outside the vocabulary"):
            writer.write([good, good, [99999]], max_new_tokens=5)
        assert writer.write([good], max_new_tokens=5) == [greedy(target, good, 5, tok.eos_token_id)]
        with pytest.raises(ConfigError, match="past the target's context of 256"):
            writer.write([good], max_new_tokens=300)


def test_regenerate_cli_replaces_assistant_turns_in_order(pair, tmp_path):
    from eagle_jax.cli.regenerate import main

    path, tok, target = pair
    convs = [
        {
            "messages": [
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "OLD1"},
                {"role": "user", "content": "and add?"},
                {"role": "assistant", "content": "OLD2"},
            ]
        },
        {
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "def"},
                {"from": "gpt", "value": "OLD3"},
            ]
        },
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(c) for c in convs) + "\n")
    main(
        [
            "--target",
            str(path),
            "--data",
            str(tmp_path / "in.jsonl"),
            "--out",
            str(tmp_path / "out.jsonl"),
            "--max-new-tokens",
            "6",
            "--batch-size",
            "2",
        ]
    )
    out = read_out(tmp_path / "out.jsonl")
    assert [[m["role"] for m in c] for c in out] == [
        ["user", "assistant", "user", "assistant"],
        ["system", "user", "assistant"],
    ]
    assert out[0][2]["content"] == "and add?" and out[1][1]["content"] == "def"
    for conv in out:
        assert_greedy_replies(conv, tok, target, 6)
    samples, stats = load_samples(tmp_path / "out.jsonl", tok, 512, progress=False)
    assert stats.kept + stats.no_loss == 2


def test_prompt_only_records_are_answered(pair, tmp_path, capsys):
    from eagle_jax.cli.regenerate import main

    path, tok, target = pair
    records = [
        {"messages": [{"role": "user", "content": "hello"}]},
        {"prompt": "def add(a, b):"},
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "OLD1"},
                {"role": "user", "content": "how are you?"},
            ]
        },
        {"messages": [{"role": "system", "content": "nothing asked"}]},  # skipped and counted
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    main(
        [
            "--target",
            str(path),
            "--data",
            str(tmp_path / "in.jsonl"),
            "--out",
            str(tmp_path / "out.jsonl"),
            "--max-new-tokens",
            "6",
            "--batch-size",
            "2",
        ]
    )
    out = read_out(tmp_path / "out.jsonl")
    assert [[m["role"] for m in c] for c in out] == [
        ["user", "assistant"],
        ["user", "assistant"],
        ["user", "assistant", "user", "assistant"],
    ]
    assert [c[0]["content"] for c in out] == ["hello", "def add(a, b):", "hi"] and out[2][2][
        "content"
    ] == "how are you?"
    for conv in out:
        assert_greedy_replies(conv, tok, target, 6)
    report = capsys.readouterr().out
    assert "in 3/4 conversations" in report and "1 skipped (no user turn to answer)" in report


def test_a_run_with_nothing_to_answer_fails(pair, tmp_path):
    from eagle_jax.cli.regenerate import main

    path, _, _ = pair
    (tmp_path / "in.jsonl").write_text(
        json.dumps({"messages": [{"role": "system", "content": "x"}]})
        + "\n"
        + json.dumps({"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "?"}]})
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["--target", str(path), "--data", str(tmp_path / "in.jsonl"), "--out", str(out)])
    assert "nothing to regenerate" in str(e.value.code) and "1 with no user turn to answer" in str(e.value.code)
    assert "1 with an assistant turn before any user turn" in str(e.value.code) and not out.exists()
    # Every prompt too long for the context: the run fails after the model is loaded, and writes nothing.
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "hello"}) + "\n")
    with pytest.raises(SystemExit) as e:
        main(
            ["--target", str(path), "--data", str(tmp_path / "in.jsonl"), "--out", str(out), "--max-new-tokens", "250"]
        )
    assert "nothing written" in str(e.value.code) and "1 cut at the context limit" in str(e.value.code)
    assert not out.exists() and not list(tmp_path.glob("out.jsonl*"))


def test_synthesize_samples_distinct_user_turns_and_answers_them(pair, tmp_path, capsys):
    from eagle_jax.cli.regenerate import main

    path, tok, target = pair
    args = [
        "--target",
        str(path),
        "--synthesize",
        "4",
        "--synth-max-tokens",
        "12",
        "--synth-min-chars",
        "2",
        "--synth-max-samples",
        "400",
        "--max-new-tokens",
        "6",
        "--batch-size",
        "2",
        "--seed",
        "3",
    ]
    main(args + ["--out", str(tmp_path / "a.jsonl")])
    report = capsys.readouterr().out
    out = read_out(tmp_path / "a.jsonl")
    assert len(out) == 4 and all([m["role"] for m in c] == ["user", "assistant"] for c in out)
    users = [c[0]["content"] for c in out]
    assert len({" ".join(u.lower().split()) for u in users}) == 4 and all(len(u) >= 2 for u in users)
    assert "4/4 user turns synthesised" in report
    for conv in out:
        assert_greedy_replies(conv, tok, target, 6)
    # Seeded: the same seed gives the same file, another seed other queries.
    main(args + ["--out", str(tmp_path / "b.jsonl")])
    assert (tmp_path / "b.jsonl").read_text() == (tmp_path / "a.jsonl").read_text()
    # Another seed, with --system: the system message comes first in every record, the queries differ.
    main(args[:-1] + ["4", "--system", "be brief", "--out", str(tmp_path / "c.jsonl")])
    other = read_out(tmp_path / "c.jsonl")
    assert other and all(
        [m["role"] for m in c] == ["system", "user", "assistant"] and c[0]["content"] == "be brief" for c in other
    )
    assert [c[1]["content"] for c in other] != users
    for conv in other:
        assert_greedy_replies(conv, tok, target, 6)


def test_synthesized_turns_are_filtered_and_deduplicated(pair):
    """The drop rules on canned samples: unfinished, too short, duplicate (case/whitespace), near-duplicate
    (same first 8 words); each batch has its own seed."""
    from eagle_jax.training.synthesize import synthesize_prompts

    _, tok, _ = pair
    end = tok.eos_token_id
    batches = [
        [
            ("Write a story about a cat who sails the sea", True),
            ("write a  story about a CAT who sails the sea ", True),
            ("Write a story about a cat who sails the moon", True),
            ("Hi", True),
        ],
        [
            ("What is the capital of France?", False),
            ("What is the capital of France?", True),
            ("Explain recursion to a child.", True),
            ("Tell me a joke about dogs.", True),
        ],
    ]
    seeds = []

    class CannedWriter:
        """Replies the canned rows, a batch per call, as a ``ReplyWriter`` of 4 slots would."""

        slots, eos_ids = 4, (end,)

        def write(self, prompts, *, seed, stop_ids, **kw):
            assert end in stop_ids and len(prompts) == 4
            seeds.append(seed)
            return [tok.encode(t, add_special_tokens=False) + [end] * ended for t, ended in batches[len(seeds) - 1]]

    prompts, stats = synthesize_prompts(CannedWriter(), tok, 3, seed=1, progress=False)
    assert prompts == [
        "Write a story about a cat who sails the sea",
        "What is the capital of France?",
        "Explain recursion to a child.",
    ]
    assert (stats.sampled, stats.kept, stats.unfinished, stats.too_short, stats.duplicates, stats.near_duplicates) == (
        7,
        3,
        1,
        1,
        1,
        1,
    )
    assert len(set(seeds)) == 2


def test_a_stopped_run_resumes_after_its_last_shard_with_the_same_result(pair, tmp_path, monkeypatch, capsys):
    """Shards of one record (data) or two prompts (--synthesize): a run stopped in its second shard keeps the
    first on disk; started again it resumes there and ends with the file an uninterrupted run writes. A finished
    output is not written again unless the run says --restart."""
    import eagle_jax.training.regenerate as regen_module
    import eagle_jax.training.synthesize as synth_module
    from eagle_jax.cli.regenerate import main

    path, _, _ = pair
    (tmp_path / "in.jsonl").write_text(
        "\n".join(json.dumps({"prompt": p}) for p in ("hello", "def add(a, b):", "hi")) + "\n"
    )
    data = [
        "--target",
        str(path),
        "--data",
        str(tmp_path / "in.jsonl"),
        "--max-new-tokens",
        "6",
        "--batch-size",
        "2",
        "--shard-size",
        "1",
    ]
    synth = [
        "--target",
        str(path),
        "--synthesize",
        "4",
        "--synth-max-tokens",
        "12",
        "--synth-min-chars",
        "2",
        "--synth-max-samples",
        "400",
        "--max-new-tokens",
        "6",
        "--batch-size",
        "2",
        "--seed",
        "3",
        "--shard-size",
        "2",
    ]
    for args, module, name in (
        (data, regen_module, "regenerate_conversations"),
        (synth, synth_module, "synthesize_conversations"),
    ):
        whole = tmp_path / f"whole-{name}.jsonl"
        main(args + ["--out", str(whole)])
        real, calls = getattr(module, name), []

        def stopped_in_shard_two(*a, **kw):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return real(*a, **kw)

        out = tmp_path / "resumed.jsonl"
        with monkeypatch.context() as m:
            m.setattr(module, name, stopped_in_shard_two)
            with pytest.raises(KeyboardInterrupt):
                main(args + ["--out", str(out)])
        assert not out.exists() and len(read_out(out.with_name("resumed.jsonl.partial"))) >= 1
        # Other settings are refused, naming them; the unfinished run is kept.
        with pytest.raises(SystemExit, match=r"max_new_tokens=6 \(now 5\)"):
            main(
                args[: args.index("--max-new-tokens")]
                + ["--max-new-tokens", "5"]
                + args[args.index("--max-new-tokens") + 2 :]
                + ["--out", str(out)]
            )
        capsys.readouterr()
        main(args + ["--out", str(out)])
        assert "resuming" in capsys.readouterr().out
        assert out.read_text() == whole.read_text() and len(read_out(out)) >= 3
        assert not list(tmp_path.glob("resumed.jsonl.*"))
        with pytest.raises(SystemExit, match="exists .* --restart"):
            main(args + ["--out", str(out)])
        assert out.read_text() == whole.read_text()
        main(args + ["--out", str(out), "--restart"])
        assert out.read_text() == whole.read_text()
        out.unlink()


def test_continuation_continues_raw_text_and_training_reads_it(pair, tmp_path, capsys):
    """--continuation: each prompt continued as raw text (no template) by the target's greedy decoding; the records
    load as training samples whose learned tokens are the continuation's."""
    from eagle_jax.cli.regenerate import main

    path, tok, target = pair
    prompts = ["def add(a, b):", "Hello there, how", "Fine"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    args = ["--target", str(path), "--data", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out.jsonl")]
    main([*args, "--continuation", "--max-new-tokens", "6", "--batch-size", "2"])
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == prompts
    for r in records:
        ids = tok(r["prompt"])["input_ids"]
        assert r["text"] == tok.decode(greedy(target, ids, 6, tok.eos_token_id), skip_special_tokens=True)
    assert "3 assistant turns generated in 3/3" in capsys.readouterr().out
    samples, _ = load_samples(tmp_path / "out.jsonl", tok, max_length=64)
    assert len(samples) == 3 and all(s.loss_mask.sum() > 0 for s in samples)

    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "no prompt"}) + "\n")
    with pytest.raises(SystemExit, match="bad.jsonl:1: continuation needs"):
        main(
            [
                "--target",
                str(path),
                "--data",
                str(tmp_path / "bad.jsonl"),
                "--out",
                str(tmp_path / "o2.jsonl"),
                "--continuation",
            ]
        )
