"""eagle-jax-eval (eagle_jax.cli.eval): real acceptance length with the engine on a held-out JSONL (chat and
completion records)."""

from __future__ import annotations

import json

import numpy as np
from transformers import AutoTokenizer

import eagle_jax
from eagle_jax import Drafter, DrafterConfig, Target, TargetConfig, save_drafter, save_target
from workshop.tokenizer_build import train_tokenizer

CORPUS = ["def add(a, b):\n    return a + b\n" * 10, "for i in range(10):\n    print(i)\n" * 10]


def test_eval_reports_the_engines_acceptance(tmp_path):
    from eagle_jax.cli.eval import eval_prompts, run

    train_tokenizer(CORPUS, vocab_size=300, out_dir=tmp_path / "target")
    tok = AutoTokenizer.from_pretrained(tmp_path / "target")
    v = len(tok)
    target = Target(
        TargetConfig(
            "llama",
            vocab_size=v,
            hidden_size=32,
            intermediate_size=64,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            max_position_embeddings=256,
        )
    )
    save_target(target, tmp_path / "target")
    drafter = Drafter(
        DrafterConfig(
            hidden_size=32,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            intermediate_size=64,
            vocab_size=v,
            draft_vocab_size=v,
            target_hidden_size=32,
        ),
        target.embed_tokens[...],
    )
    save_drafter(drafter, tmp_path / "drafter")
    records = [
        {"prompt": "def add(a, b):\n"},
        {"text": "for i in"},
        {"messages": [{"role": "user", "content": "loop"}, {"role": "assistant", "content": "OLDREPLY"}]},
    ]
    (tmp_path / "held.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = run(
        [
            "--target",
            str(tmp_path / "target"),
            "--drafter",
            str(tmp_path / "drafter"),
            "--data",
            str(tmp_path / "held.jsonl"),
            "--k",
            "3",
            "--max-new-tokens",
            "8",
            "--batch-size",
            "3",
            "--out",
            str(tmp_path / "r.json"),
        ]
    )
    (r,) = out["results"]
    # The same numbers as the engine's own statistics for the same prompts.
    prompts = eval_prompts(str(tmp_path / "held.jsonl"), tok, None)
    assert tok.decode(prompts[2]).endswith("<|assistant|>\n") and "OLDREPLY" not in tok.decode(
        prompts[2]
    )  # up to the reply
    t2 = eagle_jax.load_target(tmp_path / "target")
    res = eagle_jax.generate(
        t2,
        eagle_jax.load_drafter(tmp_path / "drafter", t2),
        prompts,
        max_new_tokens=8,
        spec={"method": "eagle3", "num_speculative_tokens": 3},
        eos_token_id=tok.eos_token_id,
        seed=0,
    )
    flat = [a for row in res.accepted for a in row]
    assert r["rounds"] == len(flat) and np.isclose(r["acceptance_length"], np.mean(flat) + 1)
    pa = r["position_acceptance"]
    assert len(pa) == 3 and all(a >= b for a, b in zip(pa, pa[1:]))
    assert json.loads((tmp_path / "r.json").read_text())["results"][0] == r
