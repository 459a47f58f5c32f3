"""The frozen target's outputs for a training set, computed once and read back by every TTT run.

The target is frozen in TTT training, so what it gives each sample (the aux states the drafter fuses,
its final-normed hidden state, from which its logits over the draft vocabulary follow, and its argmax
over the whole vocabulary, which decides whether a position is supervised) is the same in every epoch
and for every drafter trained on the same data. Computing it once removes the target's forward (and its
[B, T, V] logits) from every train step: on a 135M target with a 9.8M drafter that is about 40% of a
step's work, and two drafters compared on the same data share the one computation.

Layout of a feature directory (float32, so a run from features sees the numbers the online target
would give it):

- ``aux.f32`` [tokens, N*Ht], ``hidden.f32`` [tokens, Ht], ``argmax.i32`` [tokens]: every sample's
  rows back to back, in sample order (``offsets`` in the manifest);
- ``manifest.json``: what the features are of (the target's fingerprint, the aux layers, the data's
  fingerprint) and how many samples are done. A stopped computation resumes after the last finished
  batch; a directory made for another target, other layers or other data is refused, naming which.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from eagle_jax.modeling.layers import document_mask, project
from eagle_jax.modeling.target import Target
from eagle_jax.training.data import DataError, Sample

FORMAT_VERSION = 1
_FILES = {"aux": ("aux.f32", np.float32), "hidden": ("hidden.f32", np.float32), "argmax": ("argmax.i32", np.int32)}


class FeatureError(DataError):
    """A feature directory does not belong to this target, these aux layers or this data."""


def target_fingerprint(target: Target) -> str:
    """A digest of the target's config, dtype and a slice of its weights (embedding rows, every norm):
    enough to tell two checkpoints apart without hashing every weight."""
    h = hashlib.sha256(json.dumps(target.config.to_hf(), sort_keys=True, default=str).encode())
    h.update(str(jnp.dtype(target.dtype)).encode())
    parts = [target.embed_tokens[...][:64], target.norm.weight[...]] + [
        layer.input_layernorm.weight[...] for layer in target.layers
    ]
    for part in parts:
        h.update(np.ascontiguousarray(np.asarray(part, np.float32)).tobytes())
    return h.hexdigest()[:16]


def data_fingerprint(samples: Sequence[Sample]) -> str:
    """A digest of every sample's token ids, in order (the features do not depend on the loss masks)."""
    h = hashlib.sha256()
    for s in samples:
        h.update(np.int64(len(s)).tobytes())
        h.update(np.ascontiguousarray(s.input_ids, np.int32).tobytes())
    return h.hexdigest()[:16]


def draft_vocab_head(target: Target, used: np.ndarray) -> jax.Array:
    """The rows of the target's output matrix for the draft vocabulary's target ids ``used`` [Vd]:
    [Vd, Ht], so ``project("...h,vh->...v", hidden, head)`` gives the target's logits in draft-id order."""
    if target.lm_head is None:
        return jnp.take(target.embed_tokens[...], jnp.asarray(used), axis=0)
    return jnp.take(target.lm_head.kernel[...], jnp.asarray(used), axis=1).T


def draft_vocab_logits(hidden: jax.Array, head: jax.Array) -> jax.Array:
    """The target's logits over the draft vocabulary [..., Vd] from its final-normed hidden [..., Ht]."""
    return project("...h,vh->...v", hidden, head)


@dataclass(frozen=True)
class FeatureStore:
    """A finished feature directory, memory-mapped: ``rows(i)`` = (aux, hidden, argmax) of sample i."""

    directory: Path
    offsets: np.ndarray  # [samples + 1]
    aux: np.ndarray
    hidden: np.ndarray
    argmax: np.ndarray

    @property
    def aux_width(self) -> int:
        return int(self.aux.shape[1])

    @property
    def hidden_size(self) -> int:
        return int(self.hidden.shape[1])

    def collate(self, rows: list[np.ndarray], length: int) -> dict[str, np.ndarray]:
        """``aux``, ``target_hidden`` and ``target_argmax`` [rows, length, ...] laid out as ``data.collate``
        lays out the same rows' tokens (samples back to back, zeros on the padding)."""
        aux = np.zeros((len(rows), length, self.aux_width), np.float32)
        hidden = np.zeros((len(rows), length, self.hidden_size), np.float32)
        argmax = np.zeros((len(rows), length), np.int32)
        for r, row in enumerate(rows):
            start = 0
            for i in row:
                lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
                end = start + hi - lo
                aux[r, start:end] = self.aux[lo:hi]
                hidden[r, start:end] = self.hidden[lo:hi]
                argmax[r, start:end] = self.argmax[lo:hi]
                start = end
        return {"aux": aux, "target_hidden": hidden, "target_argmax": argmax}


def _expected(target: Target, aux_layer_ids: tuple[int, ...], samples: Sequence[Sample]) -> dict:
    return {
        "version": FORMAT_VERSION,
        "target": target_fingerprint(target),
        "aux_layer_ids": [int(i) for i in aux_layer_ids],
        "data": data_fingerprint(samples),
        "samples": len(samples),
        "tokens": int(sum(len(s) for s in samples)),
        "aux_width": len(aux_layer_ids) * target.config.hidden_size,
        "hidden_size": target.config.hidden_size,
    }


def _check_manifest(directory: Path, manifest: dict, expected: dict) -> None:
    what = {
        "version": "format version",
        "target": "target (config or weights)",
        "aux_layer_ids": "aux layers",
        "data": "training data (token ids)",
        "samples": "number of samples",
    }
    for key, name in what.items():
        if manifest.get(key) != expected[key]:
            raise FeatureError(
                f"{directory}: these features are of another {name} ({key}: {manifest.get(key)!r}, this run: "
                f"{expected[key]!r}); point data.features at a new directory or delete this one"
            )


def _write_manifest(path: Path, manifest: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest))
    tmp.replace(path)  # atomic: a stop mid-write leaves the previous manifest


def _memmaps(directory: Path, tokens: int, aux_width: int, hidden_size: int, mode: str) -> dict[str, np.ndarray]:
    shapes = {"aux": (tokens, aux_width), "hidden": (tokens, hidden_size), "argmax": (tokens,)}
    out = {}
    for key, (name, dtype) in _FILES.items():
        path = directory / name
        need = int(np.prod(shapes[key])) * np.dtype(dtype).itemsize
        if mode == "r" and (not path.exists() or path.stat().st_size != need):
            have = path.stat().st_size if path.exists() else "no"
            raise FeatureError(f"{path}: expected {need} bytes, found {have}: incomplete or damaged features")
        out[key] = np.memmap(path, dtype=dtype, mode=mode, shape=shapes[key])
    return out


def _batches(lengths: np.ndarray, start: int, rows: int, length: int) -> list[tuple[int, int, list[list[int]]]]:
    """Consecutive samples from ``start`` packed into ``rows`` rows of ``length`` tokens, each into the first row
    with room, until one fits in none: [(first, end, the sample indices of each row)], so finished samples always
    form a prefix. First fit fills the rows of a conversation set (~400-800 tokens a sample in 1024-token rows)
    better than filling one row after another (chat-c.jsonl: 71% of 2 x 1024-token rows)."""
    out, i = [], start
    while i < len(lengths):
        first, packed, free = i, [[] for _ in range(rows)], [length] * rows
        while i < len(lengths):
            n = int(lengths[i])
            r = next((r for r in range(rows) if free[r] >= n), None)
            if r is None:
                break
            packed[r].append(i)
            free[r] -= n
            i += 1
        out.append((first, i, [row for row in packed if row]))
    return out


def _forward_fn(target: Target, aux_layer_ids: tuple[int, ...]) -> Callable:
    graphdef, state = nnx.split(target)

    @jax.jit
    def run(state, ids, positions, segments):
        t = nnx.merge(graphdef, state)
        mask = document_mask(positions, segments)
        hidden, aux, _ = t.forward(ids, positions, mask, aux_layer_ids=aux_layer_ids)
        return (
            aux.astype(jnp.float32),
            hidden.astype(jnp.float32),
            jnp.argmax(t.logits(hidden), axis=-1).astype(jnp.int32),
        )

    return lambda ids, positions, segments: run(state, ids, positions, segments)


def compute_features(
    target: Target,
    samples: Sequence[Sample],
    aux_layer_ids: tuple[int, ...],
    directory: str | Path,
    *,
    rows: int = 2,
    length: int | None = None,
    progress: bool = True,
) -> FeatureStore:
    """The target's features of ``samples`` in ``directory``: computed where missing (resuming a stopped
    computation), checked against this target, these layers and these samples where present.

    The target runs on ``rows`` rows of ``length`` tokens (default: the longest sample) holding
    consecutive samples back to back, each attending only within itself, so one program is compiled.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs started together: the second waits, then reads the first's
        return _compute_locked(target, samples, tuple(aux_layer_ids), directory, rows, length, progress)


def _compute_locked(
    target: Target,
    samples: Sequence[Sample],
    aux_layer_ids: tuple[int, ...],
    directory: Path,
    rows: int,
    length: int | None,
    progress: bool,
) -> FeatureStore:
    expected = _expected(target, tuple(aux_layer_ids), samples)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in samples])]).astype(np.int64)
    manifest_path = directory / "manifest.json"
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        _check_manifest(directory, manifest, expected)
        done = int(manifest["done"])
    else:
        manifest, done = {**expected, "done": 0}, 0
        for name, _ in _FILES.values():  # sized up front (sparse): a resumed run writes into them in place
            (directory / name).unlink(missing_ok=True)
        _memmaps(directory, expected["tokens"], expected["aux_width"], expected["hidden_size"], "w+")
        _write_manifest(manifest_path, manifest)
    if done < len(samples):
        lengths = np.asarray([len(s) for s in samples])
        length = int(length or lengths.max())
        if lengths.max() > length:
            raise FeatureError(f"features: a sample has {lengths.max()} tokens, more than the row length {length}")
        out = _memmaps(directory, expected["tokens"], expected["aux_width"], expected["hidden_size"], "r+")
        forward = _forward_fn(target, tuple(aux_layer_ids))
        bar = tqdm(total=len(samples), initial=done, desc="target features", unit=" sample", disable=not progress)
        for first, end, packed in _batches(lengths, done, rows, length):
            ids = np.zeros((rows, length), np.int32)
            positions = np.tile(np.arange(length, dtype=np.int32), (rows, 1))
            segments = np.zeros((rows, length), np.int32)
            for r, row in enumerate(packed):
                start = 0
                for seg, i in enumerate(row, 1):
                    n = len(samples[i])
                    ids[r, start : start + n] = samples[i].input_ids
                    positions[r, start : start + n] = np.arange(n)
                    segments[r, start : start + n] = seg
                    start += n
            aux, hidden, argmax = (np.asarray(x) for x in forward(ids, positions, segments))
            for r, row in enumerate(packed):
                start = 0
                for i in row:
                    lo, hi = offsets[i], offsets[i + 1]
                    out["aux"][lo:hi] = aux[r, start : start + hi - lo]
                    out["hidden"][lo:hi] = hidden[r, start : start + hi - lo]
                    out["argmax"][lo:hi] = argmax[r, start : start + hi - lo]
                    start += hi - lo
            for m in out.values():
                m.flush()
            manifest["done"] = end  # only after the rows are on disk: a stop here loses this batch at most
            _write_manifest(manifest_path, manifest)
            bar.update(end - first)
        bar.close()
    maps = _memmaps(directory, expected["tokens"], expected["aux_width"], expected["hidden_size"], "r")
    return FeatureStore(directory, offsets, maps["aux"], maps["hidden"], maps["argmax"])
