"""Fills an abstract NNX module (built with ``nnx.eval_shape``) from named checkpoint tensors, and back.

Each model family supplies one function mapping an NNX state path to its checkpoint key; torch Linear
weights are [out, in] and our kernels [in, out], so every path ending in ``kernel`` has its last two
axes swapped (stacked per-expert kernels [E, in, out] included).

A variable with ``value_dtype`` metadata is a half-precision weight stored widened to float32 (on the
CPU backend, ``eagle_jax.modeling.layers.weight_matrix``): tensors are rounded to ``value_dtype`` before
the widening, and exported in it when no dtype is asked for.
"""

from __future__ import annotations

from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.checkpoint.tensor_files import CheckpointError, TensorSource

Path = tuple  # an NNX state path, e.g. ('layers', 0, 'self_attn', 'q_proj', 'kernel')
KeyFn = Callable[[Path], str]


def state_items(module: nnx.Module) -> Iterator[tuple[Path, object]]:
    """(path, leaf) for every variable of a module, paths as tuples of str/int."""
    _, state = nnx.split(module)
    for path, leaf in nnx.to_flat_state(state):
        yield tuple(int(p) if isinstance(p, int) else str(p) for p in path), leaf


def _torch_layout(shape: tuple) -> tuple:
    return (*shape[:-2], shape[-1], shape[-2])


def value_dtype(leaf) -> np.dtype | None:
    """The dtype a widened variable's values are rounded to (None: its own dtype is the values')."""
    name = leaf.get_metadata().get("value_dtype")
    return None if name is None else jnp.dtype(name)


def _convert(
    arr: np.ndarray, path: Path, expected_shape: tuple, dtype, key: str, source: TensorSource, rounded=None
) -> jax.Array:
    kernel = path[-1] == "kernel" and arr.ndim >= 2
    if kernel:
        arr = np.swapaxes(arr, -1, -2)
    if tuple(arr.shape) != tuple(expected_shape):
        # Report in the checkpoint's own (torch) layout.
        got, want = (_torch_layout(arr.shape), _torch_layout(expected_shape)) if kernel else (arr.shape, expected_shape)
        raise CheckpointError(f"{source.file_of(key)}: tensor '{key}' has shape {list(got)}, expected {list(want)}")
    arr = np.asarray(arr)
    if rounded is not None:
        arr = arr.astype(rounded, copy=False)
    return jnp.asarray(arr.astype(dtype, copy=False))


def fill_module(
    abstract: nnx.Module,
    source: TensorSource,
    key_of: KeyFn,
    *,
    provided: dict[Path, jax.Array] | None = None,
    ignored: Callable[[str], bool] = lambda k: False,
    renamed: dict[str, str] | None = None,
) -> nnx.Module:
    """Returns a concrete module whose variables are read from ``source`` one tensor at a time, each
    cast to the dtype its abstract variable declares (the module is built in the wanted dtype).

    ``provided``: values for paths not in the checkpoint (e.g. the drafter's embedding from the target).
    ``renamed``: stored key -> the normalised key ``key_of`` produces. Missing or unexpected keys and shape
    mismatches raise, naming the key and the file.
    """
    provided = provided or {}
    renamed = renamed or {}
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    wanted: dict[str, Path] = {}
    for path, _ in flat:
        wanted[key_of(tuple(path))] = tuple(path)
    stored = {renamed.get(k, k): k for k in source.keys()}
    unexpected = sorted(k for k in stored if k not in wanted and not ignored(k))
    if unexpected:
        raise CheckpointError(
            f"{source.directory}: unexpected tensors {[stored[k] for k in unexpected][:8]} "
            f"(in {source.file_of(stored[unexpected[0]]).name}); they do not belong to this model config"
        )
    for path, leaf in flat:
        path = tuple(path)
        key = key_of(path)
        spec = leaf.get_value()
        rounded = value_dtype(leaf)
        if key in stored:
            arr = source.get(stored[key])
            leaf.set_value(_convert(arr, path, spec.shape, spec.dtype, stored[key], source, rounded))
        elif path in provided:
            value = jnp.asarray(provided[path])
            leaf.set_value(value if rounded is None else value.astype(rounded).astype(spec.dtype))
        else:
            raise CheckpointError(f"{source.directory}: missing tensor '{key}' (needed for {'.'.join(map(str, path))})")
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def export_tensors(
    module: nnx.Module,
    key_of: KeyFn,
    dtype=None,
    skip: Callable[[Path], bool] = lambda p: False,
    keep_dtype: Callable[[Path], bool] = lambda p: False,
) -> Iterator[tuple[str, np.ndarray]]:
    """(checkpoint key, numpy array in torch layout) for every variable, floats cast to ``dtype`` except
    where ``keep_dtype(path)``."""
    for path, leaf in state_items(module):
        if skip(path):
            continue
        arr = np.asarray(jax.device_get(leaf.get_value()))
        if dtype is not None and jnp.issubdtype(arr.dtype, jnp.floating) and not keep_dtype(path):
            arr = arr.astype(dtype)
        elif dtype is None and value_dtype(leaf) is not None:
            arr = arr.astype(value_dtype(leaf))
        if path[-1] == "kernel" and arr.ndim >= 2:
            arr = np.ascontiguousarray(np.swapaxes(arr, -1, -2))
        yield key_of(path), arr
