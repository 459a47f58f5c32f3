"""Prompts for a base model's drafter data: openings of prose and code found on any Python machine.

    python -m train.text_prompts --out assets/gemma3/data/prompts.jsonl --count 2000

Prose: paragraphs of the installed distributions' descriptions (their METADATA) and of the standard library's
docstrings; code: the openings of the standard library's functions. Each prompt is a paragraph's or a function's
first ``--chars`` characters, cut at a word boundary, so that the target's continuation (``eagle-jax-regenerate
--continuation``) carries on the text. Duplicates (by their first 60 characters) are dropped, the rest shuffled
with ``--seed``; ``--code-share`` of the prompts are code. The EAGLE evaluation sets are never read.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import sysconfig
from importlib import metadata
from pathlib import Path
from typing import Iterator

MIN_PARAGRAPH = 200  # characters: shorter paragraphs are headings, badges and one-liners
MIN_LETTERS = 0.7  # share of letters and spaces in a prose paragraph: tables, URLs and markup fall below


def _paragraphs(text: str) -> Iterator[str]:
    for block in re.split(r"\n\s*\n", text):
        para = " ".join(block.split())
        if len(para) < MIN_PARAGRAPH:
            continue
        letters = sum(ch.isalpha() or ch == " " for ch in para) / len(para)
        if letters >= MIN_LETTERS and "http" not in para and not para.startswith(("|", "..", ">>>", "#", "*", "-")):
            yield para


def _stdlib_files() -> list[Path]:
    return sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py") if "test" not in p.parts)


def prose() -> Iterator[str]:
    for dist in sorted(metadata.distributions(), key=lambda d: d.metadata.get("Name", "")):
        yield from _paragraphs(dist.metadata.get_payload() or "")
    for path in _stdlib_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from _paragraphs(ast.get_docstring(node) or "")


def code() -> Iterator[str]:
    for path in _stdlib_files():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno >= 8:
                yield "\n".join(lines[node.lineno - 1 : node.end_lineno])


def opening(text: str, chars: int) -> str:
    """The first ``chars`` characters of ``text``, cut back to the last whitespace (the whole text if shorter)."""
    if len(text) <= chars:
        return text
    cut = text[:chars]
    space = max(cut.rfind(" "), cut.rfind("\n"))
    return cut[:space] if space > chars // 2 else cut


def prompts(count: int, chars: int, code_share: float, seed: int) -> list[str]:
    rng = random.Random(seed)
    pools = []
    for source in (prose(), code()):
        seen, pool = set(), []
        for text in source:
            head = opening(text, chars)
            if head[:60] not in seen:
                seen.add(head[:60])
                pool.append(head)
        rng.shuffle(pool)
        pools.append(pool)
    n_code = round(count * code_share)
    picked = pools[0][: count - n_code] + pools[1][:n_code]
    if len(picked) < count:
        raise SystemExit(f"error: only {len(pools[0])} prose and {len(pools[1])} code openings found, {count} asked")
    rng.shuffle(picked)
    return picked


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--count", type=int, default=2000)
    p.add_argument("--chars", type=int, default=320, help="a prompt's length at most, in characters")
    p.add_argument("--code-share", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for text in prompts(args.count, args.chars, args.code_share, args.seed):
            f.write(json.dumps({"prompt": text}) + "\n")
    print(f"{args.count} prompts -> {out}")


if __name__ == "__main__":
    main()
