"""lm-evaluation-harness against a served model: ``local-completions`` on the server against lm-eval's own ``hf``
backend on the same checkpoint file, per sample.

    python -m bench.lm_eval_parity --target gemma-3-270m
    python -m bench.lm_eval_parity --target smollm2-135m-instruct --max-len 1024

The target is served as ``eagle-jax-serve --target T --drafter none`` serves it (in this process, no programs
compiled ahead); lm-eval's ``hf`` backend loads the same file (``gguf_file=`` for a .gguf, as transformers reads
it). Three tasks written here, run as lm-eval runs any task: multiple choice, ``loglikelihood_rolling`` over the
docstrings of a few standard-library modules (texts of 1-5k tokens, cut into windows of ``--max-len``: past a
Gemma 3 sliding window of 512) and ``generate_until``. Prompts go as token ids from the served model's own
tokenizer, with its ``<bos>`` where it adds one, as the ``hf`` backend encodes them (``client_tokenizer``).
Reported: the largest log-likelihood difference (absolute, and relative past 1) and whether every ``is_greedy`` flag
and greedy text agrees. float32 on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from bench.common import TARGET_HELP, local_target, write_json

MODEL = "served"

TASKS = {
    "tiny_mc": (
        "multiple_choice",
        {
            "doc_to_text": "{{question}}",
            "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{answer}}",
            "metric_list": [{"metric": "acc"}],
        },
        [
            {"question": q, "choices": c, "answer": a}
            for q, c, a in (
                ("the cat sat on the", [" mat", " dog", " hat"], 0),
                ("a b c d", [" e", " f g", " abc"], 1),
                ("hello wor", ["ld", "m", "ld and more"], 2),
                ("xyz", [" a", " b"], 0),
            )
        ],
    ),
    "tiny_rolling": (
        "loglikelihood_rolling",
        {"doc_to_text": "", "doc_to_target": "{{text}}", "metric_list": [{"metric": "word_perplexity"}]},
        [
            {"text": t}
            for t in (
                "the quick brown fox jumps over the lazy dog.",
                "hello there, how are you today?",
                "abc def ghi jkl mno pqr stu vwx yz " * 5,
            )
        ],
    ),
    "tiny_gen": (
        "generate_until",
        {
            "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{target}}",
            "generation_kwargs": {"until": ["."], "max_gen_toks": 16, "do_sample": False},
            "metric_list": [{"metric": "exact_match"}],
        },
        [{"prompt": p, "target": "x"} for p in ("once upon a time", "the answer is", "q")],
    ),
}


def long_texts() -> list[dict]:
    """Rolling-window documents of a real model's length: a few standard-library modules' docstrings."""
    import argparse as m1
    import collections as m2
    import json as m3
    import pathlib as m4

    return [{"text": " ".join(m.__doc__.split())} for m in (m1, m2, m3, m4) if m.__doc__]


def write_tasks(root: Path, tasks: dict) -> Path:
    """Each task as a YAML file of lm-eval's own format over a local JSON file (no dataset hub needed)."""
    import yaml

    for name, (kind, fields, docs) in tasks.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        spec = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test",
            "output_type": kind,
            **fields,
        }
        (root / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    return root


def samples(model: str, model_args: str, tasks_dir: Path, names: list[str]) -> dict[str, list]:
    """Every task's responses in document order, as ``lm_eval.simple_evaluate`` logs them."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=names,
        batch_size=1,
        log_samples=True,
        task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    return {name: [s["resps"] for s in sorted(out["samples"][name], key=lambda s: s["doc_id"])] for name in names}


def flatten(resps) -> list:
    """Every response of a task's samples, in order: (log-likelihood, is_greedy) pairs, floats or texts."""
    flat = []
    for sample in resps:
        for r in sample:
            r = r[0] if isinstance(r, list) and len(r) == 1 else r
            flat.append(tuple(r) if isinstance(r, (list, tuple)) else r)
    return flat


def close(have: float, want: float) -> bool:
    """float32 agreement of a log-likelihood: 1e-3 absolute, or 1e-5 relative for large sums (a rolling window's
    -10^3 and beyond over a real model's layers: the target parity tests' bound on logits)."""
    return abs(have - want) <= 1e-3 + 1e-5 * abs(want)


def compare(reference: dict[str, list], got: dict[str, list]) -> dict:
    """Per-sample agreement of two backends' responses: the largest log-likelihood differences and the
    mismatches (a log-likelihood not ``close``, an ``is_greedy`` flag or a greedy text that differs)."""
    out = {"responses": 0, "max_abs": 0.0, "max_rel": 0.0, "mismatches": []}
    for name in reference:
        want, have = flatten(reference[name]), flatten(got[name])
        if len(want) != len(have):
            out["mismatches"].append((name, f"{len(want)} responses against {len(have)}"))
            continue
        for w, h in zip(want, have):
            out["responses"] += 1
            if isinstance(w, str):
                ok = h == w
            else:
                (wv, wg), (hv, hg) = (w, h) if isinstance(w, tuple) else ((w, None), (h, None))
                ok = close(hv, wv) and bool(hg) == bool(wg)
                out["max_abs"] = max(out["max_abs"], abs(hv - wv))
                out["max_rel"] = max(out["max_rel"], abs(hv - wv) / max(1.0, abs(wv)))
            if not ok:
                out["mismatches"].append((name, w, h))
    return out


def client_tokenizer(tokenizer, root: str | Path) -> str:
    """lm-eval API backend arguments that tokenize as its ``hf`` backend does: token-id prompts from the served
    model's own tokenizer (saved under ``root``), with its ``<bos>`` where it adds one (Gemma needs it; lm-eval's
    remote token ids never carry one, and text prompts tokenize context and continuation as one string)."""
    path = Path(root) / "client-tokenizer"
    tokenizer.save_pretrained(path)
    ids = tokenizer("a")["input_ids"]
    adds_bos = tokenizer.bos_token_id is not None and len(ids) > 0 and ids[0] == tokenizer.bos_token_id
    return f"tokenizer_backend=huggingface,tokenizer={path},tokenized_requests=True,add_bos_token={adds_bos}"


def hf_model_args(target: str, max_length: int) -> str:
    """lm-eval ``hf`` backend arguments for a checkpoint directory or a .gguf file (its folder + ``gguf_file``)."""
    path = Path(target)
    where = f"pretrained={path.parent},gguf_file={path.name}" if path.suffix == ".gguf" else f"pretrained={path}"
    return f"{where},dtype=float32,max_length={max_length},device=cpu"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help=TARGET_HELP)
    ap.add_argument("--max-len", type=int, default=1024, help="the server's context (lm-eval's window)")
    ap.add_argument("--out", default="bench/results/lm_eval_parity.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from eagle_jax.serving.server import Server, build_service

    target = local_target(args.target)
    tasks = dict(TASKS)
    kind, fields, docs = tasks["tiny_rolling"]
    tasks["tiny_rolling"] = (kind, fields, docs + long_texts())
    with tempfile.TemporaryDirectory() as tmp:
        tasks_dir = write_tasks(Path(tmp), tasks)
        names = list(tasks)
        t0 = time.perf_counter()
        # lm-eval's API backend scores max_length - 2 tokens a window (it asks for one new token too), its hf
        # backend max_length: the same windows when the hf side gets 2 fewer
        reference = samples("hf", hf_model_args(target, args.max_len - 2), tasks_dir, names)
        hf_s = time.perf_counter() - t0
        service = build_service(target, None, slots=2, max_len=args.max_len, model_name=MODEL, precompile=False)
        server = Server(service).start()
        try:
            t0 = time.perf_counter()
            base = f"model={MODEL},base_url={server.url}/v1/completions,max_length={args.max_len},num_concurrent=1"
            got = samples("local-completions", f"{base},{client_tokenizer(service.tokenizer, tmp)}", tasks_dir, names)
            served_s = time.perf_counter() - t0
        finally:
            server.stop()
    result = {"target": target, "max_len": args.max_len, **compare(reference, got), "hf_s": hf_s, "served_s": served_s}
    print(
        f"{result['responses']} responses: largest log-likelihood difference {result['max_abs']:.2e} "
        f"({result['max_rel']:.2e} relative past 1); {len(result['mismatches'])} mismatches "
        f"(hf {hf_s:.0f} s, served {served_s:.0f} s)"
    )
    for m in result["mismatches"]:
        print("  mismatch:", m)
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
