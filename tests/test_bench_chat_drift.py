"""The prompt builders of bench.chat_drift (no model): long prompts land just under each requested length
and end with the same summarisation turn; the four robustness renderings differ and keep the question."""

from __future__ import annotations

import re

import jinja2
import numpy as np
import pytest

from bench.chat_drift import PARAPHRASED_SYSTEM, VARIANTS, long_prompts, long_system_prompt, robustness_prompts
from bench.common import round_robin

# SmolLM2-Instruct's template (ChatML with a default system prompt) and a non-ChatML one.
TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
        "You are a helpful AI assistant<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
        "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ "
        "'<|im_start|>assistant\n' }}{% endif %}"
    ),
    "tagged": (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    ),
}
WORDS = "the river council said on monday that new bridge plans would cost more than expected after storms".split()


class FakeTokenizer:
    """Sub-word pieces (up to 3 word characters, or one other character; <|...|> markers whole), so
    words are several tokens and a cut at a word boundary cannot land exactly on every length."""

    def __init__(self, template: str):
        self.chat_template = template
        self.vocab: dict[str, int] = {}
        self.pieces: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        for piece in re.findall(r"<\|\w+\|>|\w{1,3}|\s|[^\w\s]", text):
            if piece not in self.vocab:
                self.vocab[piece] = len(self.pieces)
                self.pieces.append(piece)
            ids.append(self.vocab[piece])
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)

    def apply_chat_template(
        self, messages: list[dict], tokenize: bool = True, add_generation_prompt: bool = False
    ) -> str:
        assert not tokenize
        return (
            jinja2.Environment()
            .from_string(self.chat_template)
            .render(messages=messages, add_generation_prompt=add_generation_prompt)
        )


@pytest.fixture(params=list(TEMPLATES))
def tokenizer(request):
    return FakeTokenizer(TEMPLATES[request.param])


def articles(n: int = 12) -> list[str]:
    rng = np.random.default_rng(0)
    return [f"Summarize: Story{i}. " + " ".join(rng.choice(WORDS, int(rng.integers(20, 40)))) + "." for i in range(n)]


def test_long_prompts_hit_the_lengths_and_share_the_end(tokenizer):
    turns = articles()
    contexts = [200, 320, 500]
    out = long_prompts(tokenizer, turns, contexts, n=3, seed=1)
    assert list(out) == ["short", *contexts]
    ends = [p["content"] for p in out["short"]]
    assert len(set(ends)) == 3 and all(e in turns for e in ends)
    for L in contexts:
        assert len(out[L]) == 3
        for p, end in zip(out[L], ends):
            assert L - 10 <= len(p["ids"]) <= L, (L, len(p["ids"]))  # short by at most a header and a word
            assert p["content"].endswith(end) and p["content"].startswith("Background document 1:\n")
            marker = end.split(". ")[0].removeprefix("Summarize: ") + "."
            assert p["content"].count(marker) == 1  # the end article is never background too
            assert p["docs"] >= 1
            assert end in tokenizer.decode(p["ids"])
    # A longer context extends a shorter one's history: same first background document.
    assert [p["content"].split("\n\n")[0] for p in out[320]] == [p["content"].split("\n\n")[0] for p in out[500]]
    with pytest.raises(ValueError, match="run out"):
        long_prompts(tokenizer, turns, [10_000], n=1)  # not enough background text


def test_robustness_variants(tokenizer):
    questions = round_robin([["a1", "a2"], ["b1"], ["c1", "c2", "c3"]], 5)
    assert questions == ["a1", "b1", "c1", "a2", "c2"]
    system = long_system_prompt(tokenizer, 700)
    assert len(tokenizer.encode(system, add_special_tokens=False)) >= 700
    q = "How many moons does Mars have?"
    prompts = robustness_prompts(tokenizer, [q, "Name a prime number."], system)
    assert list(prompts) == list(VARIANTS)
    texts = {v: ps[0]["text"] for v, ps in prompts.items()}
    assert len(set(texts.values())) == 4 and all(q in t for t in texts.values())
    assert len({tuple(ps[0]["ids"]) for ps in prompts.values()}) == 4
    assert texts["no_template"] == q + "\n\n"
    assert system in texts["long_system"] and system not in texts["default"]
    assert PARAPHRASED_SYSTEM in texts["paraphrased"] and f"Question: {q}\nPlease answer." in texts["paraphrased"]
    if "<|im_start|>" in tokenizer.chat_template:  # rendered by hand: the default system prompt must not creep in
        assert "helpful AI assistant" in texts["default"] and "helpful AI assistant" not in texts["paraphrased"]
        assert texts["paraphrased"].endswith("<|im_end|>\n<|im_start|>assistant\n")
