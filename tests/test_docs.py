"""README.md and docs/*.md are run, so they cannot drift from the code; BENCHMARKS.md's commands are parsed.

Every fenced block is python, bash or text (text: output or a diagram, not run). A block runs unless a
comment on the line before marks it:

- ``<!-- doc-test: check -->``: not run (training runs, benches, real-model fetches, a GPU, pip). Each command
  must name an existing entry point (a console script of pyproject.toml, ``python -m MODULE``, ``pip install``
  of existing extras, ``pytest`` over existing paths, an installed external client), and that entry point's
  argparse parser must accept the command's arguments as written; a python block must compile and every
  ``eagle_jax.NAME`` it uses must exist.
- ``<!-- doc-test: needs MODEL -->``: run only where the named model (``eagle-jax-fetch MODEL``) is cached.

Python blocks run in order per page, sharing one scope. Bash blocks run from the repository root; a ``curl``
command is sent to an in-process server of a small pair (as ``tests/test_api_requests.py`` runs
serve/EXAMPLES.md), with the documented address and model name replaced. Inline commands in backticks
(``python -m ...``, ``eagle-jax...``) must name an entry point whose parser has every flag they use; paths in
backticks and links between the documents (anchors included) must exist.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BENCHMARKS = REPO / "BENCHMARKS.md"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SCRIPTS = PYPROJECT["project"]["scripts"]
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
EXTERNAL = {"lm_eval", "guidellm"}  # the standard clients (the clients extra): checked to be installed
DOC_URL = "http://127.0.0.1:8000"
DOC_MODEL = '"target"'

BLOCK = re.compile(
    r"(?:^<!-- doc-test: (?P<mark>[^>]*?) -->\n)?^```(?P<info>[^\n`]*)\n(?P<code>.*?)^```\s*$", re.S | re.M
)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH_ROOTS = (
    "eagle_jax/",
    "bench/",
    "configs/",
    "tests/",
    "parity_tests/",
    "serve/",
    "train/",
    "workshop/",
    "assets/",
    "docs/",
    ".ci/",
)
TOP_FILES = {"pyproject.toml", "conftest.py", "README.md", "BENCHMARKS.md"}
OUTPUTS = ("bench/results", "parity_tests/.last_parity_errors.json")  # written by the benches and the parity tests


def blocks(page: Path) -> list[dict]:
    text = page.read_text()
    found = [
        dict(
            mark=(m["mark"] or "").strip(),
            lang=m["info"].strip(),
            code=m["code"],
            line=text[: m.start()].count("\n") + 1,
        )
        for m in BLOCK.finditer(text)
    ]
    assert text.count("\n```") - text.count("\n````") >= 2 * len(found), f"{page.name}: a fence BLOCK did not match"
    return found


def prose(page: Path) -> str:
    """The page without its fenced blocks."""
    return BLOCK.sub("", page.read_text())


# ------------------------------------------------------------------------------------------ commands


def commands(code: str) -> list[list[str]]:
    """Simple commands of a bash block: continuation lines joined, comments dropped, split at && ; |."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        tokens = shlex.split(line, comments=True)
        cmd: list[str] = []
        for t in tokens + [";"]:
            if t in ("&&", ";", "|", "||"):
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(t)
    return out


def _without_env(cmd: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while cmd and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", cmd[0]):
        k, v = cmd[0].split("=", 1)
        env[k], cmd = v, cmd[1:]
    return env, cmd


class _Parser(Exception):
    def __init__(self, parser):
        self.parser = parser


def _main_of(cmd: list[str]):
    """The ``main`` function an entry point runs, and the arguments it gets; None for other programs."""
    if cmd[0] in SCRIPTS:
        module, func = SCRIPTS[cmd[0]].split(":")
        return getattr(importlib.import_module(module), func), cmd[1:]
    if cmd[:2] == ["python", "-m"] and cmd[2] != "pytest":
        name = cmd[2]
        spec = importlib.util.find_spec(name)
        assert spec is not None, f"python -m {name}: no such module"
        if spec.submodule_search_locations:  # a package: its __main__
            name += ".__main__"
        module = importlib.import_module(name)
        assert hasattr(module, "main"), f"python -m {cmd[2]}: {name} has no main()"
        return module.main, cmd[3:]
    return None


def parser_of(cmd: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The argparse parser an entry point builds (its main() is stopped at parse_args)."""
    main, argv = _main_of(cmd)

    def capture(self, *a, **kw):
        raise _Parser(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture
    try:
        main(argv)
    except _Parser as e:
        return e.parser, argv
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError(f"{shlex.join(cmd)}: main() returned without parsing its arguments")


def check_command(cmd: list[str], where: str, *, full: bool = True) -> None:
    """The command names an existing entry point and its parser takes the arguments (``full``: all of them, as
    written; else only that every --flag used is one of its options)."""
    _, cmd = _without_env(cmd)
    if not cmd:
        return
    what = f"{where}: `{shlex.join(cmd)}`"
    if cmd[0] == "pip":
        assert cmd[1:3] == ["install", "-e"], what
        extras = re.fullmatch(r"\.(?:\[([\w,]+)\])?", cmd[3])
        assert extras, what
        for extra in filter(None, (extras[1] or "").split(",")):
            assert extra in EXTRAS, f"{what}: no extra {extra!r} in pyproject.toml"
        return
    if cmd[:3] == ["python", "-m", "pytest"]:
        for arg in cmd[3:]:
            if not arg.startswith("-") and not re.fullmatch(r"\d+", arg):
                path, _, test = arg.partition("::")
                assert (REPO / path).exists(), f"{what}: no {path}"
                assert not test or f"def {test}" in (REPO / path).read_text(), f"{what}: no test {test} in {path}"
        return
    if cmd[0] in EXTERNAL:
        if shutil.which(cmd[0]) is None:
            warnings.warn(f"{what}: {cmd[0]} is not installed (the clients extra), not checked")
        return
    if cmd[0] == "curl":
        for arg in cmd[cmd.index("-d") + 1 :][:1]:
            json.loads(arg)
        return
    assert _main_of(cmd) is not None, f"{what}: not an entry point of this project"
    parser, argv = parser_of(cmd)
    if full:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                parser.parse_args(argv)
            except SystemExit as e:
                raise AssertionError(f"{what}: its parser refuses the arguments:\n{err.getvalue()}") from e
    else:
        options = {s for action in parser._actions for s in action.option_strings}
        for flag in (a.split("=")[0] for a in argv if a.startswith("-")):
            assert flag in options, f"{what}: {flag} is not an option of it"


def check_python(code: str, where: str) -> None:
    compile(code, where, "exec")
    import eagle_jax

    for dotted in set(re.findall(r"\beagle_jax((?:\.\w+)+)", code)):
        obj, path = eagle_jax, "eagle_jax"
        for name in dotted.strip(".").split("."):
            if not hasattr(obj, name):
                try:
                    obj = importlib.import_module(f"{path}.{name}")
                except ImportError:
                    raise AssertionError(f"{where}: eagle_jax{dotted} does not exist") from None
            else:
                obj = getattr(obj, name)
            path += "." + name
            if not isinstance(obj, type(eagle_jax)):
                break


# ------------------------------------------------------------------------------------------ static checks


def test_every_block_is_runnable_or_marked():
    for page in [*PAGES, BENCHMARKS]:
        for b in blocks(page):
            where = f"{page.name}:{b['line']}"
            assert b["lang"] in ("python", "bash", "text"), (
                f"{where}: a ```{b['lang']} block (python, bash or text only)"
            )
            assert b["mark"] in ("", "check") or re.fullmatch(r"needs [\w.-]+", b["mark"]), (
                f"{where}: unknown mark {b['mark']!r}"
            )
            assert not (b["lang"] == "text" and b["mark"]), f"{where}: a text block is never run, so needs no mark"


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m[1]) for m in re.finditer(r"^#+ (.*)$", prose(page), re.M)}


def test_paths_and_links_exist():
    for page in PAGES + [BENCHMARKS]:
        text = prose(page)
        for span in INLINE.findall(text):
            if (
                re.fullmatch(r"[\w./-]+(::\w+)?", span)
                and (span.startswith(PATH_ROOTS) or span in TOP_FILES)
                and not span.startswith(OUTPUTS)
            ):
                path, _, test = span.partition("::")
                assert (REPO / path).exists(), f"{page.name}: `{span}` does not exist"
                assert not test or f"def {test}" in (REPO / path).read_text(), f"{page.name}: no {test} in {path}"
        for link in LINK.findall(page.read_text()):
            if re.match(r"\w+://", link):
                continue
            target, _, anchor = link.partition("#")
            dest = (page.parent / target).resolve() if target else page
            assert dest.exists(), f"{page.name}: the link {link} leads nowhere"
            if anchor and dest.suffix == ".md":
                assert anchor in _anchors(dest), f"{page.name}: {dest.name} has no heading #{anchor}"


def test_checked_commands_parse():
    """Blocks marked check, every bash block of BENCHMARKS.md, and inline commands: entry points and flags."""
    for page in [*PAGES, BENCHMARKS]:
        for b in blocks(page):
            where = f"{page.name}:{b['line']}"
            if b["mark"] != "check" and page != BENCHMARKS:
                continue
            if b["lang"] == "bash":
                for cmd in commands(b["code"]):
                    check_command(cmd, where)
            elif b["lang"] == "python":
                check_python(b["code"], where)
        for span in INLINE.findall(prose(page)):
            if re.match(r"(python -m \w|eagle-jax(-\w+)? |eagle-jax(-\w+)?$)", span):
                for cmd in commands(span):
                    check_command(cmd, f"{page.name}: inline", full=False)


def test_readme_keeps_the_setup_commands_first():
    first = blocks(PAGES[0])[0]
    assert first["lang"] == "bash" and first["code"].splitlines()[:2] == [
        'pip install -e ".[dev]" && python -m eagle_jax          # main job: a code completion, plain vs speculative',
        'pip install -e ".[dev]" && python -m pytest -q          # the tests (CPU; GPU cases run when CUDA is visible)',
    ]
    assert len(PAGES[0].read_text().splitlines()) <= 250 and len(BENCHMARKS.read_text().splitlines()) <= 800


# ------------------------------------------------------------------------------------------ running the pages


@pytest.fixture(scope="module")
def doc_server():
    """A server of the serving tests' small pair, the model name and address the documents' requests are sent to."""
    pytest.importorskip("fastapi")
    from engine_models import markov_pair
    from serving_models import build_tokenizer

    from eagle_jax import SpecConfig
    from eagle_jax.serving import SpecSchedule
    from eagle_jax.serving.server import Server, make_service

    target, drafter = markov_pair()
    tok = build_tokenizer()
    eos = (tok.eos_token_id,) if tok.eos_token_id is not None else ()
    service = make_service(
        target,
        drafter,
        tok,
        SpecSchedule.fixed(SpecConfig(num_speculative_tokens=2)),
        eos,
        slots=1,
        max_len=128,
        rounds_per_step=2,
        model_name="markov",
        precompile=False,
    )
    srv = Server(service).start()
    yield srv
    srv.stop()


def _run_bash(code: str, where: str, request) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for cmd in commands(code):
        if cmd[0] == "curl":
            server = request.getfixturevalue("doc_server")
            url = cmd[[i for i, a in enumerate(cmd) if a.startswith("http")][0]].replace(DOC_URL, server.url)
            body = json.loads(cmd[cmd.index("-d") + 1].replace(DOC_MODEL, '"markov"'))
            import httpx

            r = httpx.post(url, json=body, timeout=300)
            assert r.status_code == 200, f"{where}: {shlex.join(cmd)} -> {r.status_code} {r.text}"
            continue
        extra, argv = _without_env(cmd)
        p = subprocess.run(argv, cwd=REPO, env={**env, **extra}, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, (
            f"{where}: `{shlex.join(cmd)}` exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
        )


def _needs(mark: str) -> str | None:
    """Why a ``needs MODEL`` block cannot run here, or None."""
    from eagle_jax.checkpoint.models import model_path

    name = mark.split()[1]
    return None if model_path(name).exists() else f"{name} is not fetched (eagle-jax-fetch {name})"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_runs(page, request):
    scope: dict = {"__name__": f"doc_{page.stem}"}
    skipped = []
    for b in blocks(page):
        where = f"{page.name}:{b['line']}"
        if b["lang"] == "text" or b["mark"] == "check":
            continue
        if b["mark"].startswith("needs"):
            why = _needs(b["mark"])
            if why:
                skipped.append(f"{where}: {why}")
                continue
        if b["lang"] == "bash":
            _run_bash(b["code"], where, request)
            continue
        code = b["code"]
        if DOC_URL in code:
            server = request.getfixturevalue("doc_server")
            code = code.replace(DOC_URL, server.url).replace(DOC_MODEL, '"markov"')
        exec(compile(code, where, "exec"), scope)
    if skipped:
        pytest.skip("; ".join(skipped))
