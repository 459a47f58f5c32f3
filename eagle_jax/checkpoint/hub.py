"""Checkpoint locations: a local directory, or a Hugging Face Hub repo id fetched into the HF cache.

``huggingface_hub.snapshot_download`` does the fetching, so HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE and
HF_TOKEN mean what they mean everywhere else; a snapshot already cached is used without the network.
Only the files a loader reads are fetched: configs, tokenizer files and the weights.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from eagle_jax.checkpoint.tensor_files import CheckpointError

# Configs (config.json, generation_config.json, shard indexes, tokenizer JSONs), safetensors weights and
# the tokenizer's non-JSON files (sentencepiece, tiktoken, BPE merges, a separate chat template).
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt", "*.jinja"]
# pytorch_model.bin is fetched only when a repo has no safetensors: many repos ship both, and the .bin
# copy would double the download for nothing.
BIN_PATTERNS = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]

# "name" or "org/name" as the Hub spells them: word characters, '-' and '.', each part starting and
# ending with a letter, digit or '_' (huggingface_hub's own validation, without importing it).
_REPO_ID = re.compile(r"^(?:\w(?:[\w.-]*\w)?/)?\w(?:[\w.-]*\w)?$")


def looks_like_local_path(text: str) -> bool:
    """True for what can only be a filesystem path: absolute, ``~``, ``./`` / ``../``, a drive letter,
    a backslash, or more than one '/' (a repo id has at most one)."""
    return (
        text in (".", "..")
        or text.startswith(("/", "~", "./", "../", ".\\", "..\\"))
        or os.path.isabs(text)
        or bool(re.match(r"^[A-Za-z]:", text))
        or "\\" in text
        or text.count("/") > 1
    )


def looks_like_repo_id(text: str) -> bool:
    """True for ``name`` / ``org/name`` strings that the Hub accepts as a model repo id."""
    return (
        len(text) <= 96
        and bool(_REPO_ID.match(text))
        and ".." not in text
        and "--" not in text
        and not looks_like_local_path(text)
    )


def resolve_checkpoint(path_or_id: str | os.PathLike, *, revision: str | None = None) -> Path:
    """A local checkpoint directory for ``path_or_id``.

    An existing path is returned as it is (``revision`` must then be None). A string that names no
    existing path and reads as a Hub repo id (``org/name`` or ``name``) is fetched with
    ``huggingface_hub.snapshot_download`` at ``revision`` (branch, tag or commit; default ``main``)
    into the HF cache, or found there when cached or offline; the snapshot directory is returned.
    Anything else, and every Hub failure, raises ``CheckpointError`` saying what to do.
    """
    path = Path(path_or_id).expanduser()
    if path.exists():
        if revision is not None:
            raise CheckpointError(
                f"revision '{revision}' was given for the local directory {path}; revisions apply to Hub repo ids only"
            )
        return path
    text = os.fspath(path_or_id)
    if not isinstance(path_or_id, str) or not looks_like_repo_id(text):
        raise CheckpointError(
            f"no such checkpoint directory: {text} (give an existing directory, or a Hugging Face Hub repo id such as "
            "'org/name')"
        )
    return _snapshot(text, revision)


def _snapshot(repo_id: str, revision: str | None) -> Path:
    try:
        import huggingface_hub
        from huggingface_hub import constants
        from huggingface_hub.utils import (
            GatedRepoError,
            HfHubHTTPError,
            HFValidationError,
            LocalEntryNotFoundError,
            OfflineModeIsEnabled,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError as e:  # a core dependency; only a broken install lacks it
        raise CheckpointError(
            f"'{repo_id}' is not a local directory, and huggingface_hub is needed to fetch it from the Hub ({e})"
        ) from e

    at = f"'{repo_id}'" + (f" at revision '{revision}'" if revision else "")
    local = f"no local directory '{repo_id}' exists either"
    try:
        folder = Path(
            huggingface_hub.snapshot_download(
                repo_id, revision=revision, allow_patterns=HUB_PATTERNS, library_name="eagle_jax"
            )
        )
        if not any(folder.glob("*.safetensors")):
            folder = Path(
                huggingface_hub.snapshot_download(
                    repo_id, revision=revision, allow_patterns=BIN_PATTERNS, library_name="eagle_jax"
                )
            )
        return folder
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        if constants.HF_HUB_OFFLINE:
            raise CheckpointError(
                f"Hub repo {at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set: "
                f"download it once with network access (unset HF_HUB_OFFLINE, or `hf download {repo_id}`), point "
                f"HF_HOME / HF_HUB_CACHE at a cache that holds it, or pass a local checkpoint directory ({local})"
            ) from e
        raise CheckpointError(
            f"Hub repo {at} could not be fetched and is not in the Hugging Face cache ({constants.HF_HUB_CACHE}): "
            f"check the network connection (or HF_ENDPOINT), or pass a local checkpoint directory ({local}). Cause: {e}"
        ) from e
    except GatedRepoError as e:
        raise CheckpointError(
            f"Hub repo {at} is gated: accept its terms on the Hub and log in (`hf auth login` or HF_TOKEN)"
        ) from e
    except RevisionNotFoundError as e:
        raise CheckpointError(
            f"Hub repo '{repo_id}' has no revision '{revision}' (a branch, tag or commit hash)"
        ) from e
    except RepositoryNotFoundError as e:
        raise CheckpointError(
            f"Hub repo '{repo_id}' was not found (or is private: log in with `hf auth login` or set HF_TOKEN), and "
            f"{local}"
        ) from e
    except HFValidationError as e:
        raise CheckpointError(f"'{repo_id}' is neither a local directory nor a valid Hub repo id ({e})") from e
    except (HfHubHTTPError, OSError) as e:
        raise CheckpointError(f"fetching Hub repo {at} failed: {e}") from e


__all__ = ["resolve_checkpoint", "looks_like_repo_id", "looks_like_local_path", "HUB_PATTERNS", "BIN_PATTERNS"]
