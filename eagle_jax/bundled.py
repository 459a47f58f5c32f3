"""Where the bundled code models and the repository's configs are, independent of the working directory.

The bundle (``assets/``: the target, its EAGLE-3 and EAGLE-3.1 drafters, the tokenizer and the corpus
manifest) and ``configs/`` sit beside the package in the repository, so they are found from the
package's own location; an editable install (``pip install -e .``) keeps that layout. A wheel
carries only the package, and then every accessor raises ``BundleNotFound`` saying so.
"""

from __future__ import annotations

from pathlib import Path

from eagle_jax.checkpoint.tensor_files import CheckpointError

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "assets"
CONFIGS = REPO / "configs"
DRAFTER_VARIANTS = {"eagle3": "drafter-eagle3", "eagle3.1": "drafter-eagle3.1"}
DEFAULT_DRAFTER = "eagle3.1"


class BundleNotFound(CheckpointError):
    """A bundled model, the tokenizer, the manifest or a repository config is not where the package expects it."""


def _require(path: Path, what: str, needed: str) -> Path:
    if not (path / needed).exists():
        raise BundleNotFound(
            f"the bundled {what} is not at {path} (no {needed}): the bundle lives in the repository's assets/ and "
            f"configs/ beside the eagle_jax package, which an editable install from a clone (pip install -e .) keeps; "
            f"pass explicit checkpoint paths or Hub ids instead"
        )
    return path


def target_dir() -> Path:
    """The bundled target (HF Llama layout, tokenizer files included)."""
    return _require(ASSETS / "target", "target", "model.safetensors")


def drafter_dir(variant: str = DEFAULT_DRAFTER) -> Path:
    """The bundled drafter ``variant``: "eagle3" or "eagle3.1" (EAGLE checkpoint layout)."""
    if variant not in DRAFTER_VARIANTS:
        raise BundleNotFound(f"no bundled drafter '{variant}'; the bundle has {sorted(DRAFTER_VARIANTS)}")
    return _require(ASSETS / DRAFTER_VARIANTS[variant], f"{variant} drafter", "model.safetensors")


def tokenizer_dir() -> Path:
    """The bundled models' tokenizer."""
    return _require(ASSETS / "tokenizer", "tokenizer", "tokenizer.json")


def manifest_path() -> Path:
    """The corpus manifest (file list and train/held-out split, pinned by hash)."""
    return _require(ASSETS / "data", "corpus manifest", "manifest.json") / "manifest.json"


def config_path(relative: str) -> Path:
    """A file under the repository's ``configs/``, e.g. ``"serve/bundled.yaml"``."""
    path = CONFIGS / relative
    if not path.is_file():
        raise BundleNotFound(
            f"no config at {path}: the repository's configs/ is beside the eagle_jax package only in an editable "
            f"install from a clone (pip install -e .)"
        )
    return path


def available(variant: str = DEFAULT_DRAFTER) -> bool:
    """True when the bundled target and drafter ``variant`` are both present."""
    try:
        target_dir(), drafter_dir(variant)
    except BundleNotFound:
        return False
    return True


__all__ = [
    "ASSETS",
    "CONFIGS",
    "REPO",
    "BundleNotFound",
    "available",
    "config_path",
    "drafter_dir",
    "manifest_path",
    "target_dir",
    "tokenizer_dir",
]
