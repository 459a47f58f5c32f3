"""Reproducible code corpus: the Python source of the running interpreter's standard library, and of
permissively licensed installed packages.

The bundled tiny code model is trained on the ``.py`` files of the standard library. The source of
permissively licensed packages the project itself installs (``PACKAGES``) can be added to it
(``workshop.pretrain_target --with-packages``; tried, and not used for the bundled target).
``build_manifest`` records exactly which files (and which bytes, via sha256) make up each
split; ``load_corpus`` re-reads them and refuses to continue if anything differs, so a run
on a different Python version fails loudly instead of silently training on other data.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import random
import sys
import sysconfig
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

MANIFEST_FORMAT = 1
MAX_FILE_BYTES = 200_000
HELDOUT_PERCENT = 5
SPLITS = ("train", "heldout")
# Where load_corpus reads the files when no root is given, in place of the running interpreter's own
# (a machine whose Python is not the manifest's, e.g. a GPU host benchmarking the bundled pair, reads a
# copy of the manifest's files from there).
CORPUS_ROOT_ENV = "EAGLE_JAX_CORPUS_ROOT"

# Directory names excluded anywhere in the relative path.
_EXCLUDED_DIR_NAMES = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests"})
# Top-level directories excluded (idlelib; lib2to3's test data lives under lib2to3/tests).
_EXCLUDED_TOP_DIRS = frozenset({"idlelib"})


# Packages whose source extends the training data: installed by the project's own dependencies, so any
# machine that installs it can rebuild the corpus (the manifest pins their versions and file hashes).
PACKAGES = ("jax", "flax", "optax", "numpy", "orbax-checkpoint", "huggingface_hub")
# Licence names (SPDX expressions, free-text License fields, trove classifiers) accepted as permissive.
_PERMISSIVE = ("apache", "mit", "bsd", "psf", "python software foundation", "isc", "0bsd", "zlib")


class CorpusMismatchError(RuntimeError):
    """A file listed in the manifest is missing or its content differs from the recorded hash."""


def _usable_source(path: Path) -> bool:
    """A regular file of at most ``MAX_FILE_BYTES`` that decodes as UTF-8."""
    if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
        return False
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded(rel: Path) -> bool:
    parts = rel.parts
    dirs = parts[:-1]
    if any(d in _EXCLUDED_DIR_NAMES for d in dirs):
        return True
    if dirs and dirs[0] in _EXCLUDED_TOP_DIRS:
        return True
    # Build-configuration files embed machine-specific install paths.
    if dirs and dirs[0].startswith("config-"):
        return True
    if len(parts) == 1 and parts[0].startswith("_sysconfigdata"):
        return True
    return False


def stdlib_source_files(root: str | os.PathLike | None = None) -> list[Path]:
    """The standard library's ``.py`` files that make up the corpus, sorted by relative path.

    Excludes ``site-packages``, ``test``/``tests`` directories (which covers lib2to3's test
    data), ``idlelib``, ``__pycache__``, build-configuration files that embed install paths,
    files over ``MAX_FILE_BYTES`` and files that are not valid UTF-8.
    """
    root = Path(root) if root is not None else stdlib_root()
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        # Prune excluded directories early (site-packages can be huge).
        dirnames[:] = [d for d in dirnames if not _excluded(rel_dir / d / "x.py")]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            rel = rel_dir / name
            if _excluded(rel):
                continue
            path = Path(dirpath) / name
            if _usable_source(path):
                found.append((rel.as_posix(), path))
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


def package_root() -> Path:
    """Directory of the running interpreter's installed pure-Python packages."""
    return Path(sysconfig.get_paths()["purelib"])


def package_license(distribution: str) -> str:
    """The distribution's licence as its metadata states it; ValueError if that is not permissive."""
    from importlib import metadata

    meta = metadata.metadata(distribution)
    # The most specific statement first: the SPDX expression, then the classifier, then the free text.
    stated = [meta.get("License-Expression") or ""]
    stated += [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    stated += [(meta.get("License") or "").strip().split("\n")[0]]
    stated = [x for x in stated if x]
    if not stated or not any(p in stated[0].lower() for p in _PERMISSIVE):
        raise ValueError(
            f"{distribution}: licence {stated[0] if stated else 'unstated'!r} is not one of the permissive "
            f"{_PERMISSIVE}"
        )
    return stated[0]


def package_source_files(distributions: Sequence[str] = PACKAGES, root: Path | None = None) -> list[Path]:
    """The ``.py`` files the given installed distributions own under ``root`` (default
    ``package_root()``), with the standard library's exclusions (tests, oversized, not UTF-8),
    sorted by relative path. Each distribution must be installed and permissively licensed."""
    from importlib import metadata

    root = root or package_root()
    resolved = root.resolve()
    found = []
    for name in distributions:
        package_license(name)
        dist = metadata.distribution(name)
        for f in dist.files or []:
            path = Path(dist.locate_file(f)).resolve()
            if path.suffix != ".py" or not path.is_relative_to(resolved):
                continue
            rel = path.relative_to(resolved)
            if not _excluded(rel) and _usable_source(path):
                found.append(rel)
    return [root / r for r in sorted(set(found), key=lambda r: r.as_posix())]


def split_of(relative_path: str) -> str:
    """Split ("train" or "heldout") of a file, from a hash of its posix relative path."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:8], "big") % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def _python_info() -> dict:
    return {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "hexversion": sys.hexversion,
    }


def build_manifest(
    out_path: str | os.PathLike,
    root: str | os.PathLike | None = None,
    files: Iterable[str | os.PathLike] | None = None,
    packages: Sequence[str] | None = None,
) -> dict:
    """Write a JSON manifest of the corpus to ``out_path`` and return it.

    The standard library by default: ``root`` defaults to its directory and ``files`` (absolute, or
    relative to ``root``) to ``stdlib_source_files(root)``. With ``packages``, the source of those
    installed distributions instead (``package_source_files``), their versions and licences recorded.
    Paths are stored relative to ``root``.
    """
    root_path = Path(root) if root is not None else stdlib_root() if packages is None else package_root()
    if files is not None:
        paths = [Path(f) for f in files]
    else:
        paths = stdlib_source_files(root_path) if packages is None else package_source_files(packages, root_path)
    entries = []
    for path in paths:
        abs_path = path if path.is_absolute() else root_path / path
        rel = abs_path.relative_to(root_path).as_posix()
        data = abs_path.read_bytes()
        entries.append(
            {
                "path": rel,
                "split": split_of(rel),
                "sha256": hashlib.sha256(data).hexdigest(),
                "bytes": len(data),
            }
        )
    entries.sort(key=lambda e: e["path"])
    totals = {s: {"files": 0, "bytes": 0} for s in SPLITS}
    for e in entries:
        totals[e["split"]]["files"] += 1
        totals[e["split"]]["bytes"] += e["bytes"]
    fingerprint = hashlib.sha256("".join(f"{e['path']}\0{e['sha256']}\n" for e in entries).encode("utf-8")).hexdigest()
    manifest = {
        "format": MANIFEST_FORMAT,
        "source": "python-stdlib" if packages is None else "python-packages",
        "python": _python_info(),
        "heldout_percent": HELDOUT_PERCENT,
        "max_file_bytes": MAX_FILE_BYTES,
        "corpus_sha256": fingerprint,
        "totals": totals,
        "files": entries,
    }
    if packages is not None:
        from importlib import metadata

        manifest["packages"] = {p: {"version": metadata.version(p), "license": package_license(p)} for p in packages}
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def load_corpus(
    manifest_path: str | os.PathLike,
    split: str,
    root: str | os.PathLike | None = None,
) -> list[str]:
    """Read the texts of ``split`` listed in the manifest, verifying every file's sha256.

    Raises ``CorpusMismatchError`` naming the offending file if one is missing or changed
    (e.g. when running on a different Python version than the manifest was built with; then point
    ``EAGLE_JAX_CORPUS_ROOT`` at a copy of the manifest's files, as ``root`` would).
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    manifest = json.loads(Path(manifest_path).read_text(encoding="utf-8"))
    from_packages = manifest.get("source") == "python-packages"
    root = root if root is not None else os.environ.get(CORPUS_ROOT_ENV) or None
    root_path = Path(root) if root is not None else package_root() if from_packages else stdlib_root()
    built_with = manifest.get("python", {}).get("version", "?")
    hint = f" (manifest built with Python {built_with}, running Python {platform.python_version()}"
    if from_packages:
        pinned = ", ".join(f"{p}=={v['version']}" for p, v in manifest["packages"].items())
        hint += f"; it pins {pinned}"
    hint += f"; corpus root {root_path.name!r}; {CORPUS_ROOT_ENV} names another)"
    texts = []
    for entry in manifest["files"]:
        if entry["split"] != split:
            continue
        path = root_path / entry["path"]
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CorpusMismatchError(f"corpus file missing: {entry['path']}{hint}") from None
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry["sha256"]:
            raise CorpusMismatchError(
                f"corpus file changed: {entry['path']} has sha256 {digest[:16]}..., "
                f"manifest expects {entry['sha256'][:16]}...{hint}"
            )
        texts.append(data.decode("utf-8"))
    return texts


def _line_starts(text: str) -> list[int]:
    """Character offset of the start of each line (1-based line ``k`` at index ``k - 1``).

    Splits on ``\\n`` only, matching ``ast`` line numbers for LF/CRLF sources (unlike
    ``str.splitlines``, which also splits on form feeds and other separators).
    """
    starts = [0]
    pos = text.find("\n")
    while pos != -1:
        starts.append(pos + 1)
        pos = text.find("\n", pos + 1)
    starts.append(len(text))  # sentinel: "start" of the line after the last one
    return starts


def _line_offset(starts: list[int], lineno: int) -> int:
    """Offset of the start of 1-based line ``lineno`` (clamped to the end of the text)."""
    return starts[min(lineno - 1, len(starts) - 1)]


def _chunk_candidates(text: str) -> list[tuple[int, int, int, str, int]]:
    """Top-level def/class chunks as (header_end, body_end, lineno, name, chunk_start) offsets.

    ``header_end`` is the offset just after the def/class line (or after the docstring if
    present); ``body_end`` the offset just after the chunk's last line.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            return []
    starts = _line_starts(text)
    lines = text.split("\n")
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        body = node.body
        if body[0].lineno <= node.lineno or node.end_lineno is None:
            continue  # one-liner such as ``def f(): pass``
        # Header ends at the last code line before the first body statement (skipping
        # blank and comment-only lines that sit between the signature and the body).
        header_last = node.lineno
        for ln in range(body[0].lineno - 1, node.lineno - 1, -1):
            stripped = lines[ln - 1].strip()
            if stripped and not stripped.startswith("#"):
                header_last = ln
                break
        first = body[0]
        has_doc = (
            isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
        )
        if has_doc:
            if len(body) == 1:
                continue  # docstring only: nothing to complete
            if first.end_lineno is None or body[1].lineno <= first.end_lineno:
                continue  # ``"""doc"""; x = 1`` on one line: no clean split point
            header_last = first.end_lineno
        header_end = _line_offset(starts, header_last + 1)
        body_end = _line_offset(starts, node.end_lineno + 1)
        if body_end <= header_end or not text[header_end:body_end].strip():
            continue
        chunk_start = _line_offset(starts, node.decorator_list[0].lineno if node.decorator_list else node.lineno)
        out.append((header_end, body_end, node.lineno, node.name, chunk_start))
    return out


def _trim_to_line(text: str, start: int, end: int, max_chars: int) -> int:
    """Smallest line-start offset ``>= end - max_chars`` within ``[start, end]``."""
    lo = max(start, end - max_chars)
    if lo == start or text[lo - 1] == "\n":
        return lo
    nl = text.find("\n", lo, end)
    return end if nl == -1 else nl + 1


def code_prompts(
    texts: Sequence[str],
    n: int,
    seed: int = 0,
    min_chars: int = 200,
    max_chars: int = 2000,
    *,
    max_reference_chars: int | None = None,
) -> list[dict]:
    """Deterministically sample ``n`` completion prompts at top-level ``def``/``class`` chunks.

    Each result is ``{"prompt", "reference", "text_index", "name", "lineno"}``: ``prompt`` is
    the source text up to and including the def/class line (and its docstring if present),
    left-truncated at a line boundary to at most ``max_chars`` characters; ``reference`` is
    the rest of that def/class body (at most ``max_reference_chars``, cut at a line boundary,
    when given). Candidates whose prompt would be shorter than ``min_chars`` or whose
    header alone exceeds ``max_chars`` are skipped. Sampling is uniform without replacement
    over all candidates, so fewer than ``n`` are returned if there are not enough.
    """
    candidates: list[tuple[int, int, tuple[int, int, int, str, int]]] = []
    for i, text in enumerate(texts):
        for cand in _chunk_candidates(text):
            header_end, _, _, _, chunk_start = cand
            # The header (from decorators to def line/docstring) must fit in max_chars.
            if header_end - chunk_start > max_chars:
                continue
            start = _trim_to_line(text, 0, header_end, max_chars)
            if header_end - start < min_chars:
                continue
            candidates.append((i, start, cand))
    rng = random.Random(seed)
    picked = rng.sample(range(len(candidates)), min(n, len(candidates)))
    results = []
    for idx in picked:
        i, start, (header_end, body_end, lineno, name, _) = candidates[idx]
        text = texts[i]
        prompt = text[start:header_end]
        ref_end = body_end
        if max_reference_chars is not None and body_end - header_end > max_reference_chars:
            cut = text.rfind("\n", header_end, header_end + max_reference_chars)
            ref_end = cut + 1 if cut != -1 else header_end + max_reference_chars
        results.append(
            {
                "prompt": prompt,
                "reference": text[header_end:ref_end],
                "text_index": i,
                "name": name,
                "lineno": lineno,
            }
        )
    return results
