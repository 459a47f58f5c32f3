"""Data generation throughput: replies written by static batches (``generate``) against continuous batching
(``training.replies.ReplyWriter``, what ``eagle-jax-regenerate`` runs), on the same chat prompts in one run.

    python -m bench.data_generation --target smollm2-135m-instruct --batch 48 --max-new 512 \
        --questions ../shared/data/eval/mt_bench.jsonl ../shared/data/eval/alpaca.jsonl --n-questions 48

Static batches run ``--batch`` prompts at a time until the batch's longest reply ends; the writer keeps
``--batch`` rows busy, a row whose reply ends taking the next prompt. Both stop at the chat template's end of turn
and greedy replies must agree token for token (the run fails otherwise). tok/s = reply tokens / wall time, compiles
included (each path compiles in its first batch). ``--only writer`` times the writer alone (larger prompt sets).
"""

from __future__ import annotations

import argparse
import time

import eagle_jax
from bench.common import TARGET_HELP, chat_prompts, print_table, write_json
from eagle_jax.decoding.calls import eos_ids
from eagle_jax.generate import generate
from eagle_jax.training.chat import end_of_turn_ids
from eagle_jax.training.replies import ReplyWriter


def static_batches(target, prompts: list[list[int]], batch: int, max_new: int, stops: list[int]) -> list[list[int]]:
    out = []
    for i in range(0, len(prompts), batch):
        rows = prompts[i : i + batch]
        res = generate(target, None, rows + rows[-1:] * (batch - len(rows)), max_new_tokens=max_new, eos_token_id=stops)
        out += [list(t) for t in res.tokens[: len(rows)]]
    return out


def continuous(target, prompts: list[list[int]], batch: int, max_new: int, stops: list[int], eos) -> list[list[int]]:
    with ReplyWriter(target, None, slots=batch, eos_ids=eos) as writer:
        return writer.write(prompts, max_new_tokens=max_new, stop_ids=stops)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct", help=TARGET_HELP)
    ap.add_argument("--questions", nargs="+", required=True, help="FastChat question files (first turns)")
    ap.add_argument("--n-questions", type=int, default=0, help="the first N of each file (0: all)")
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--only", choices=["static", "writer"], help="time one path only")
    ap.add_argument("--out", default="bench/results/data_generation.json")
    args = ap.parse_args(argv)

    target = eagle_jax.load_target(args.target, dtype="float32")
    tok = eagle_jax.load_tokenizer(args.target)
    prompts = [q["ids"] for q in chat_prompts(args.questions, tok, args.n_questions)]
    eos = eos_ids(target, tok)
    stops = sorted(set(eos) | end_of_turn_ids(tok))
    runs = {
        "static": lambda: static_batches(target, prompts, args.batch, args.max_new, stops),
        "writer": lambda: continuous(target, prompts, args.batch, args.max_new, stops, eos),
    }
    rows, replies, record = [], {}, {"target": args.target, "prompts": len(prompts), **vars(args)}
    for name, run in runs.items():
        if args.only and name != args.only:
            continue
        t0 = time.perf_counter()
        replies[name] = run()
        seconds = time.perf_counter() - t0
        n = sum(map(len, replies[name]))
        record[name] = {"seconds": seconds, "tokens": n, "tok_s": n / seconds}
        rows.append([name, len(prompts), args.batch, f"{seconds:.1f}", n, f"{n / seconds:.1f}"])
    print_table(["path", "prompts", "rows", "seconds", "reply tokens", "tok/s"], rows)
    if len(replies) == 2 and replies["static"] != replies["writer"]:
        raise SystemExit("error: the writer's greedy replies differ from the static batches'")
    write_json(args.out, record)


if __name__ == "__main__":
    main()
