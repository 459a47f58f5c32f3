"""Tests for the stdlib code corpus and the byte-level BPE tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workshop.corpus import (
    CorpusMismatchError,
    build_manifest,
    code_prompts,
    load_corpus,
    split_of,
    stdlib_root,
    stdlib_source_files,
)
from workshop.tokenizer_build import END_TOKEN, train_tokenizer

SAMPLE_SOURCES = [
    '"""Module docstring."""\n\nimport os\n\nCONST = 3\n\n\n'
    "def add(a, b):\n"
    '    """Add two numbers."""\n'
    "    total = a + b\n"
    "    return total\n\n\n"
    "@decorator\n"
    "def scaled(x,\n"
    "           factor=2):\n"
    "    # comment line\n"
    "    return x * factor\n\n\n"
    "class Point:\n"
    '    """A 2-D point."""\n\n'
    "    def __init__(self, x, y):\n"
    "        self.x = x\n"
    "        self.y = y\n\n"
    "    def norm(self):\n"
    "        return (self.x ** 2 + self.y ** 2) ** 0.5\n",
    "import sys\n\n\ndef main(argv):\n\tif not argv:\n\t\treturn 1\n\tfor a in argv:\n\t\tprint(a)\n"
    "\treturn 0\n\n\nclass E(Exception): pass\n",
    "x = {'caf\u00e9': '\u2603', \"tab\": '\\t'}\ndef  spaced( a ,b ):   \n        return   a+b   # trailing  \n\n",
]


def test_split_determinism_and_ratio() -> None:
    paths = [f"pkg{i // 50}/module_{i}.py" for i in range(20_000)]
    splits = [split_of(p) for p in paths]
    assert splits == [split_of(p) for p in paths]
    assert set(splits) == {"train", "heldout"}
    ratio = splits.count("heldout") / len(splits)
    assert 0.04 < ratio < 0.06


def test_stdlib_source_files_excludes_and_sorted() -> None:
    root = stdlib_root()
    files = stdlib_source_files()
    rels = [f.relative_to(root).as_posix() for f in files]
    assert len(files) > 300
    assert rels == sorted(rels)
    assert "os.py" in rels
    for rel in rels:
        parts = rel.split("/")
        assert parts[0] not in ("site-packages", "idlelib")
        assert "test" not in parts[:-1] and "tests" not in parts[:-1]
        assert "__pycache__" not in parts
    assert all(f.stat().st_size <= 200_000 for f in files)


def _make_tree(tmp_path: Path) -> Path:
    root = tmp_path / "lib"
    for i in range(60):
        p = root / f"pkg{i % 4}" / f"m{i}.py"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"def f{i}(x):\n    return x + {i}\n", encoding="utf-8")
    for excluded in ("test/t.py", "pkg0/tests/t.py", "site-packages/s.py", "idlelib/i.py", "pkg1/__pycache__/c.py"):
        p = root / excluded
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x = 1\n", encoding="utf-8")
    (root / "latin1.py").write_bytes(b"s = '\xe9'\n")
    (root / "big.py").write_text("#" * 200_001, encoding="utf-8")
    return root


def test_source_file_filter(tmp_path: Path) -> None:
    root = _make_tree(tmp_path)
    rels = [f.relative_to(root).as_posix() for f in stdlib_source_files(root)]
    assert len(rels) == 60
    assert all(r.startswith("pkg") and "/m" in r for r in rels)


def test_manifest_roundtrip_and_mismatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _make_tree(tmp_path)
    manifest_path = tmp_path / "data" / "manifest.json"
    files = stdlib_source_files(root)
    manifest = build_manifest(manifest_path, root=root, files=files)
    on_disk = json.loads(manifest_path.read_text(encoding="utf-8"))
    assert on_disk == manifest
    assert "version" in manifest["python"]
    n_train = manifest["totals"]["train"]["files"]
    n_heldout = manifest["totals"]["heldout"]["files"]
    assert n_train + n_heldout == 60
    assert sum(e["bytes"] for e in manifest["files"]) == sum(t["bytes"] for t in manifest["totals"].values())
    for e in manifest["files"]:
        assert e["split"] == split_of(e["path"])

    train = load_corpus(manifest_path, "train", root=root)
    assert len(train) == n_train
    assert len(load_corpus(manifest_path, "heldout", root=root)) == n_heldout
    # A copy of the files elsewhere (another interpreter's machine) is named by the environment.
    monkeypatch.setenv("EAGLE_JAX_CORPUS_ROOT", str(root))
    assert load_corpus(manifest_path, "heldout") == load_corpus(manifest_path, "heldout", root=root)
    monkeypatch.delenv("EAGLE_JAX_CORPUS_ROOT")
    # Relative file lists give the same manifest.
    rel_files = [f.relative_to(root) for f in files]
    assert build_manifest(tmp_path / "m2.json", root=root, files=rel_files)["files"] == manifest["files"]

    victim = next(e["path"] for e in manifest["files"] if e["split"] == "train")
    (root / victim).write_text("def changed():\n    pass\n", encoding="utf-8")
    with pytest.raises(CorpusMismatchError, match=victim):
        load_corpus(manifest_path, "train", root=root)
    (root / victim).unlink()
    with pytest.raises(CorpusMismatchError, match=victim):
        load_corpus(manifest_path, "train", root=root)
    with pytest.raises(ValueError):
        load_corpus(manifest_path, "validation", root=root)


def test_code_prompts_deterministic_and_well_formed() -> None:
    a = code_prompts(SAMPLE_SOURCES, n=10, seed=3, min_chars=0, max_chars=400)
    b = code_prompts(SAMPLE_SOURCES, n=10, seed=3, min_chars=0, max_chars=400)
    assert a == b
    names = {p["name"] for p in a}
    # One-liner ``class E(Exception): pass`` is not a candidate.
    assert names == {"add", "scaled", "Point", "main", "spaced"}
    by_name = {p["name"]: p for p in a}
    assert by_name["add"]["prompt"].endswith('def add(a, b):\n    """Add two numbers."""\n')
    assert by_name["add"]["reference"] == "    total = a + b\n    return total\n"
    assert by_name["scaled"]["prompt"].endswith("@decorator\ndef scaled(x,\n           factor=2):\n")
    assert by_name["scaled"]["reference"] == "    # comment line\n    return x * factor\n"
    assert by_name["Point"]["prompt"].endswith('class Point:\n    """A 2-D point."""\n')
    assert by_name["main"]["reference"].startswith("\tif not argv:\n")
    for p in a:
        src = SAMPLE_SOURCES[p["text_index"]]
        assert (p["prompt"] + p["reference"]) in src
        assert len(p["prompt"]) <= 400
        assert p["prompt"] == "" or src.find(p["prompt"]) == 0 or src[src.find(p["prompt"]) - 1] == "\n"

    short = code_prompts(SAMPLE_SOURCES, n=10, seed=3, min_chars=0, max_chars=60)
    assert all(len(p["prompt"]) <= 60 for p in short)
    assert code_prompts(SAMPLE_SOURCES, n=10, seed=3, min_chars=10_000, max_chars=20_000) == []
    capped = code_prompts(SAMPLE_SOURCES, n=10, seed=0, min_chars=0, max_chars=400, max_reference_chars=20)
    assert all(len(p["reference"]) <= 20 for p in capped)
    assert len(code_prompts(SAMPLE_SOURCES, n=2, seed=1, min_chars=0, max_chars=400)) == 2


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    transformers = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("tok")
    texts = SAMPLE_SOURCES * 20 + [Path(__file__).read_text(encoding="utf-8")]
    train_tokenizer(texts, vocab_size=400, out_dir=out)
    return transformers.AutoTokenizer.from_pretrained(out)


def test_tokenizer_files_and_roundtrip(small_tokenizer) -> None:
    tok = small_tokenizer
    assert tok.is_fast
    assert len(tok) == 400
    assert tok.bos_token == "<|begin_of_text|>"
    assert tok.eos_token == END_TOKEN
    assert tok.pad_token == "<|pad|>"
    samples = SAMPLE_SOURCES + [
        "class A:\n\tdef f(self):\n\t\treturn '\\t'  \n\n\n    \t mixed\r\n",
        "  leading spaces\n",
        "unicode: \u00e9\u00df\u4e2d\U0001f600 \x0c formfeed\n",
        "",
    ]
    for text in samples:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        # Plain encoding adds no bos/eos.
        assert tok.encode(text) == ids


def test_chat_template_assistant_mask(small_tokenizer) -> None:
    tok = small_tokenizer
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "write add"},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "ok."},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|begin_of_text|><|system|>\nbe brief<|end|>\n<|user|>\nwrite add<|end|>\n"
        "<|assistant|>\ndef add(a, b):\n    return a + b<|end|>\n<|user|>\nthanks<|end|>\n"
        "<|assistant|>\nok.<|end|>\n"
    )
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("write add<|end|>\n<|assistant|>\n")

    out = tok.apply_chat_template(messages, tokenize=True, return_assistant_tokens_mask=True, return_dict=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask)
    assert ids[0] == tok.bos_token_id
    end_id = tok.convert_tokens_to_ids(END_TOKEN)
    expected_spans = [
        tok.encode("def add(a, b):\n    return a + b", add_special_tokens=False) + [end_id],
        tok.encode("ok.", add_special_tokens=False) + [end_id],
    ]
    # Masked positions form exactly the assistant content + <|end|> runs, in order.
    runs, cur = [], []
    for tid, m in zip(ids, mask):
        if m:
            cur.append(tid)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    assert runs == expected_spans
    assert sum(mask) == sum(len(s) for s in expected_spans)


def test_package_corpus_is_permissive_pinned_and_checked(tmp_path: Path, monkeypatch) -> None:
    """The package source (continued pretraining's extra data): an installed distribution's own .py files
    without its tests, its version and licence in the manifest, a changed file named with the pins."""
    from importlib import metadata

    from workshop.corpus import package_license, package_root, package_source_files

    files = package_source_files(["optax"])
    rels = [f.relative_to(package_root()).as_posix() for f in files]
    assert rels and all(r.startswith("optax/") and r.endswith(".py") for r in rels)
    assert not any("/tests/" in r or "/test/" in r for r in rels) and rels == sorted(rels)

    # A copy of the files under another root: the manifest pins optax's version, a changed file names it.
    root = tmp_path / "site"
    for f, r in zip(files, rels):
        (root / r).parent.mkdir(parents=True, exist_ok=True)
        (root / r).write_bytes(f.read_bytes())
    manifest = build_manifest(tmp_path / "packages.json", root=root, files=rels, packages=["optax"])
    assert manifest["source"] == "python-packages"
    assert manifest["packages"]["optax"]["version"] == metadata.version("optax")
    assert len(load_corpus(tmp_path / "packages.json", "train", root=root)) == manifest["totals"]["train"]["files"]
    victim = next(e["path"] for e in manifest["files"] if e["split"] == "train")
    (root / victim).write_text("x = 1\n", encoding="utf-8")
    with pytest.raises(CorpusMismatchError, match=f"optax=={metadata.version('optax')}"):
        load_corpus(tmp_path / "packages.json", "train", root=root)

    from email.message import Message

    gpl = Message()
    gpl["License-Expression"] = "GPL-3.0-only"
    monkeypatch.setattr(metadata, "metadata", lambda name: gpl)
    with pytest.raises(ValueError, match="optax: licence 'GPL-3.0-only' is not one of the permissive"):
        package_license("optax")
