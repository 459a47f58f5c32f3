"""Write the assistant turns of a chat dataset with the target model itself.

Usage: ``eagle-jax-regenerate --target DIR|ID|FILE.gguf --data in.jsonl --out out.jsonl --max-new-tokens 1024
[--drafter DIR] [--temperature 0] [--batch-size 16] [--tokenizer DIR] [--limit N]``, or, with no
dataset, ``eagle-jax-regenerate --target ... --synthesize N --out out.jsonl [--system TEXT]``.

Input records: ``{"messages": [...]}``, ShareGPT ``{"conversations": [...]}`` or ``{"prompt": "..."}``
(one user turn). Every assistant turn is replaced by the target's reply, and a conversation ending with
a user turn (a prompt-only record) gets one appended. ``--synthesize N`` samples N distinct user turns
from the target itself (Magpie: the template's text before a user query, continued by the model) and
answers them. Output records are ``{"messages": [...]}``, ready for ``eagle-jax-train``. A drafter
(optional) only makes it faster: greedy output is the target's own either way. A run that would write
no record fails, saying why. Work is done in shards of ``--shard-size`` records (or prompts), each kept
on disk when it completes (``eagle_jax.training.shards``): a stopped run started again with the same
settings resumes after its last completed shard, with the same result.

``--continuation`` is for base models (no chat template): ``{"prompt": "..."}`` records are continued as raw
text, and the output records are ``{"prompt": ..., "text": <the target's continuation>}``, which training
reads with the prompt as context and learns the continuation.
"""

from __future__ import annotations

import argparse
from collections import Counter

from eagle_jax.training.chat import DataError, check_chat_template
from eagle_jax.training.data import read_jsonl
from eagle_jax.training.regenerate import RegenStats, conversation_of, prompt_of, unanswerable
from eagle_jax.training.shards import ShardedOutput
from eagle_jax.training.synthesize import SynthStats, batch_seed


def _read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts of --data for --continuation (at most --limit), read before any model is loaded."""
    prompts = []
    for where, record in read_jsonl(args.data):
        prompts.append(prompt_of(record, where))
        if args.limit and len(prompts) >= args.limit:
            break
    if not prompts:
        raise SystemExit(f"error: nothing to continue in {args.data}: the file has no records")
    return prompts


def _read(args: argparse.Namespace) -> list[list[dict[str, str]]]:
    """The records of --data (at most --limit), failing before any model is loaded when none has a user turn to
    answer."""
    conversations, reasons = [], {}
    for where, record in read_jsonl(args.data):
        conv = conversation_of(record, where)
        conversations.append(conv)
        why = unanswerable(conv)
        if why is not None:
            reasons[why] = reasons.get(why, 0) + 1
        if args.limit and len(conversations) >= args.limit:
            break
    if sum(reasons.values()) == len(conversations):
        detail = ", ".join(f"{n} with {why}" for why, n in sorted(reasons.items())) or "the file has no records"
        raise SystemExit(f"error: nothing to regenerate in {args.data}: {len(conversations)} records, {detail}")
    return conversations


def _why_empty(stats: RegenStats, max_new_tokens: int, context: int) -> str:
    parts = [f"{n} with {why}" for why, n in sorted(stats.skipped.items())]
    if stats.dropped_at_limit:
        parts.append(
            f"{stats.dropped_at_limit} cut at the context limit before their first reply (prompt + "
            f"--max-new-tokens {max_new_tokens} > the target's {context} positions)"
        )
    return f"of {stats.conversations} conversations, " + ", ".join(parts or ["none was answered"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--target", required=True, help="target: HF checkpoint directory, Hub repo id, .gguf file or model name"
    )
    p.add_argument("--data", help="input JSONL (chat, ShareGPT or prompt records); not with --synthesize")
    p.add_argument("--out", required=True, help="output JSONL")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="per assistant reply")
    p.add_argument("--temperature", type=float, default=0.0, help="for the replies (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="for the replies, with --temperature > 0")
    p.add_argument("--drafter", help="EAGLE drafter directory or Hub repo id, to speed generation up (optional)")
    p.add_argument("--tokenizer", help="default: the target's")
    p.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="rows generated at once (a row whose reply ends takes the next prompt)",
    )
    p.add_argument("--dtype", default=None, help="target dtype (default: the checkpoint's)")
    p.add_argument("--limit", type=int, help="only the first N records of --data")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--shard-size",
        type=int,
        default=256,
        help="records (or synthesised prompts) per shard; each completed shard is on disk, and a run "
        "started again with the same settings resumes after the last one",
    )
    p.add_argument(
        "--continuation",
        action="store_true",
        help="continue the {'prompt': str} records of --data as raw text (base models, no chat template)",
    )
    p.add_argument(
        "--restart",
        action="store_true",
        help="start --out afresh: an unfinished run's shards are discarded, a finished output is overwritten",
    )
    g = p.add_argument_group("prompts without a dataset (Magpie)")
    g.add_argument(
        "--synthesize", type=int, metavar="N", help="sample N distinct user turns from the target and answer them"
    )
    g.add_argument(
        "--system", help="a system message put before each synthesised user turn (default: the template's own)"
    )
    g.add_argument("--synth-temperature", type=float, default=1.0, help="for the user turns (default 1.0, as Magpie)")
    g.add_argument("--synth-top-p", type=float, default=1.0, help="for the user turns (default 1.0, as Magpie)")
    g.add_argument(
        "--synth-max-tokens", type=int, default=256, help="per user turn; turns that do not end by then are dropped"
    )
    g.add_argument("--synth-min-chars", type=int, default=10, help="shorter user turns are dropped")
    g.add_argument("--synth-max-samples", type=int, help="user turns sampled at most (default 10 * N)")
    args = p.parse_args(argv)
    if (args.data is None) == (args.synthesize is None):
        p.error("give either --data FILE or --synthesize N")
    if args.shard_size < 1:
        p.error("--shard-size must be >= 1")
    if args.system is not None and args.synthesize is None:
        p.error("--system is for --synthesize")
    if args.continuation and args.data is None:
        p.error("--continuation continues the prompts of --data")

    from eagle_jax import load_drafter, load_target  # after parsing: --help stays fast
    from eagle_jax.checkpoint.tokenizer import load_tokenizer
    from eagle_jax.decoding.calls import eos_ids
    from eagle_jax.training.replies import ReplyWriter

    try:
        tok = load_tokenizer(args.tokenizer or args.target)
        if args.continuation:
            prompts, conversations = _read_prompts(args), None
        else:
            check_chat_template(tok, args.tokenizer or args.target)
            prompts, conversations = None, _read(args) if args.data is not None else None
        output = ShardedOutput(args.out, _fingerprint(args), restart=args.restart)
        if output.resumed:
            print(
                f"resuming {args.out}: {output.shards} shards done ({output.inputs_done} inputs, {output.written} "
                "records)"
            )
        target = load_target(args.target, args.dtype)
        drafter = load_drafter(args.drafter, target) if args.drafter else None
        answer = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p)
        with ReplyWriter(target, drafter, slots=args.batch_size, eos_ids=eos_ids(target, tok)) as writer:
            if prompts is not None:
                _continuation_shards(output, prompts, writer, tok, answer, args)
            elif conversations is not None:
                _regenerate_shards(output, conversations, writer, tok, answer, args)
            else:
                _synthesize_shards(output, writer, tok, answer, args)
    except DataError as e:
        raise SystemExit(f"error: {e}") from None
    totals = output.totals
    regen = RegenStats(
        **{k: totals.get(k, 0) for k in REGEN_COUNTS},
        skipped=Counter({k[len("skipped: ") :]: v for k, v in totals.items() if k.startswith("skipped: ")}),
    )
    output.finish()
    if args.synthesize is not None:
        print(SynthStats(**{k: totals.get(f"synth {k}", 0) for k in SYNTH_COUNTS}).summary())
    if not output.written:
        why = _why_empty(regen, args.max_new_tokens, target.config.max_position_embeddings)
        raise SystemExit(f"error: nothing written to {args.out}: {why}")
    print(f"{regen.summary()} -> {args.out}")


REGEN_COUNTS = ("conversations", "turns", "truncated", "dropped_at_limit", "unfinished", "generated_tokens")
SYNTH_COUNTS = ("wanted", "sampled", "kept", "unfinished", "too_short", "duplicates", "near_duplicates")


def _fingerprint(args: argparse.Namespace) -> dict:
    """The settings a resumed run must share with the run it continues (everything that changes the output)."""
    keys = (
        "target",
        "data",
        "tokenizer",
        "max_new_tokens",
        "temperature",
        "top_p",
        "drafter",
        "dtype",
        "limit",
        "seed",
        "synthesize",
        "system",
        "synth_temperature",
        "synth_top_p",
        "synth_max_tokens",
        "synth_min_chars",
        "synth_max_samples",
        "shard_size",
        "batch_size",
    )
    out = {k: getattr(args, k) for k in keys}
    if args.continuation:  # only where set: runs made before the flag existed still resume
        out["continuation"] = True
    return out


def _regen_counts(stats: RegenStats) -> dict[str, int]:
    counts = {k: getattr(stats, k) for k in REGEN_COUNTS}
    counts.update({f"skipped: {why}": n for why, n in stats.skipped.items()})
    return counts


def _regenerate_shards(
    output: ShardedOutput, conversations: list, writer, tok, answer: dict, args: argparse.Namespace
) -> None:
    from eagle_jax.training.regenerate import regenerate_conversations

    for start in range(output.inputs_done, len(conversations), args.shard_size):
        shard = conversations[start : start + args.shard_size]
        out, stats = regenerate_conversations(writer, shard, tok, seed=batch_seed(args.seed, output.shards), **answer)
        output.append([{"messages": m} for m in out], len(shard), _regen_counts(stats))
        print(
            f"shard {output.shards}: {output.inputs_done}/{len(conversations)} records done, {output.written} written",
            flush=True,
        )


def _continuation_shards(
    output: ShardedOutput, prompts: list[str], writer, tok, answer: dict, args: argparse.Namespace
) -> None:
    from eagle_jax.training.regenerate import continue_prompts

    for start in range(output.inputs_done, len(prompts), args.shard_size):
        shard = prompts[start : start + args.shard_size]
        out, stats = continue_prompts(writer, shard, tok, seed=batch_seed(args.seed, output.shards), **answer)
        output.append(out, len(shard), _regen_counts(stats))
        print(
            f"shard {output.shards}: {output.inputs_done}/{len(prompts)} prompts done, {output.written} written",
            flush=True,
        )


def _synthesize_shards(output: ShardedOutput, writer, tok, answer: dict, args: argparse.Namespace) -> None:
    from eagle_jax.training.synthesize import synthesize_conversations

    kept = output.totals.get("synth kept", 0)
    cap = args.synth_max_samples if args.synth_max_samples is not None else 10 * args.synthesize
    while kept < args.synthesize and output.totals.get("synth sampled", 0) < cap:
        n = min(args.shard_size, args.synthesize - kept)
        earlier = [m["content"] for r in output.records() for m in r["messages"] if m["role"] == "user"]
        convs, synth, stats = synthesize_conversations(
            writer,
            tok,
            n,
            system=args.system,
            query_max_tokens=args.synth_max_tokens,
            query_temperature=args.synth_temperature,
            query_top_p=args.synth_top_p,
            min_chars=args.synth_min_chars,
            max_samples=min(10 * n, cap - output.totals.get("synth sampled", 0)),
            seed=batch_seed(args.seed, output.shards),
            exclude=earlier,
            **answer,
        )
        counts = _regen_counts(stats)
        counts.update({f"synth {k}": getattr(synth, k) for k in SYNTH_COUNTS})
        output.append([{"messages": m} for m in convs], synth.kept, counts)
        kept += synth.kept
        print(
            f"shard {output.shards}: {kept}/{args.synthesize} user turns, {output.written} conversations written",
            flush=True,
        )
        if not synth.kept:
            break  # the sample cap was reached without a new query


if __name__ == "__main__":
    main()
