"""Device mesh and the ONE table of logical -> mesh axis rules for parameters, KV caches and batches.

Mesh axes: ``data`` (pure data parallel), ``fsdp`` (data parallel with parameters sharded, gathered per
use), ``expert`` (expert parallel: the routed experts of a mixture-of-experts layer; present only when
asked for), ``model`` (tensor parallel: attention heads, MLP hidden units, vocabulary). A parameter is
described by the logical names of its axes (``PARAM_RULES``, matched on the NNX variable path); the
logical names map to mesh axes through ``LOGICAL_AXES``. A dimension that does not divide by its mesh
axes' size is replicated instead (correct, just not sharded), so any model runs on any mesh.

Tensor-parallel layout (Megatron): q/k/v and gate/up are column-parallel (output over ``model``),
o_proj and down_proj row-parallel (input over ``model``); the residual stream is replicated over
``model``. Embedding rows and lm_head columns (the vocabulary) go over ``model`` as well.

Mixture of experts: the stacked expert kernels [E, in, out] put their experts over ``expert`` and,
inside each expert, the hidden units over ``model`` (the dense MLP's layout); the router and the
shared experts follow the dense rules. Activations are not split over ``expert`` (every expert shard
sees all tokens and computes those routed to its experts); the compiled program combines the shards.
MLA: the query and key/value up-projections (q_b_proj, kv_b_proj, or a direct q_proj) are
column-parallel over heads; the down-projections to the latents are replicated over ``model``, as is
the latent cache, which every head reads.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "model")
EXPERT_MESH_AXES = ("data", "fsdp", "expert", "model")

# Logical axis -> mesh axis (or axes, or None = replicated).
LOGICAL_AXES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "seq": None,
    "embed": "fsdp",  # the hidden width H: FSDP-sharded in weights
    "heads": "model",  # q heads * head_dim, kv heads * head_dim
    "kv_heads": "model",
    "head_dim": None,
    "mlp": "model",
    "vocab": "model",
    "fused_in": "model",  # the drafter's fc input N * Ht (row-parallel)
    "expert": "expert",  # the routed experts of a MoE layer
    "latent": None,  # MLA's compressed query / key-value latents
    "norm": None,
}

# (regex searched in the '/'-joined variable path, logical axes of the array). First match wins;
# anything unmatched (norm weights, d2t, t2d, optimiser counters) is replicated.
PARAM_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"(^|/)experts/(gate_proj|up_proj)/kernel$", ("expert", "embed", "mlp")),
    (r"(^|/)experts/down_proj/kernel$", ("expert", "mlp", "embed")),
    (r"(^|/)(q_a_proj|kv_a_proj_with_mqa)/kernel$", ("embed", "latent")),
    (r"(^|/)(q_b_proj|kv_b_proj)/kernel$", ("latent", "heads")),
    (r"(^|/)(q_proj|k_proj|v_proj)/kernel$", ("embed", "heads")),
    (r"(^|/)(q_proj|k_proj|v_proj)/bias$", ("heads",)),
    (r"(^|/)o_proj/kernel$", ("heads", "embed")),
    (r"(^|/)(gate_proj|up_proj)/kernel$", ("embed", "mlp")),
    (r"(^|/)down_proj/kernel$", ("mlp", "embed")),
    (r"(^|/)embed_tokens$", ("vocab", "embed")),
    (r"(^|/)lm_head/kernel$", ("embed", "vocab")),
    (r"(^|/)fc/kernel$", ("fused_in", "embed")),
)
KV_CACHE_AXES = ("batch", "kv_heads", "seq", "head_dim")  # head-major, as KVCache stores it
BATCH_AXES = ("batch", "seq")


def make_mesh(
    data: int = 1, fsdp: int = 1, model: int = 1, devices: Sequence[jax.Device] | None = None, *, expert: int = 1
) -> Mesh:
    """A (data, fsdp, model) mesh over ``devices`` (default: all devices of all processes); with
    ``expert`` > 1, a (data, fsdp, expert, model) mesh. Rules naming an axis a mesh lacks replicate."""
    devices = list(jax.devices() if devices is None else devices)
    if expert == 1:
        sizes, axes = (data, fsdp, model), MESH_AXES
    else:
        sizes, axes = (data, fsdp, expert, model), EXPERT_MESH_AXES
    n = int(np.prod(sizes))
    if n != len(devices):
        shape = " x ".join(f"{a}={s}" for a, s in zip(axes, sizes))
        raise ValueError(f"mesh {shape} = {n} devices, but {len(devices)} are given")
    return Mesh(np.asarray(devices, dtype=object).reshape(sizes), axes)


def logical_to_spec(
    axes: Sequence[str | None], shape: Sequence[int] | None = None, mesh: Mesh | None = None
) -> PartitionSpec:
    """PartitionSpec for logical ``axes``; with ``shape`` and ``mesh``, non-dividing dims are replicated."""
    out: list[Any] = []
    used: set[str] = set()
    for i, name in enumerate(axes):
        target = LOGICAL_AXES.get(name) if name is not None else None
        names = (target,) if isinstance(target, str) else tuple(target or ())
        names = tuple(a for a in names if a not in used)  # a mesh axis may shard only one dim
        if mesh is not None:
            names = tuple(a for a in names if a in mesh.shape)
            size = int(np.prod([mesh.shape[a] for a in names])) if names else 1
            if shape is not None and (size == 1 or shape[i] % size):
                names = ()
        used.update(names)
        out.append(None if not names else names[0] if len(names) == 1 else names)
    return PartitionSpec(*out)


def path_str(path: Sequence[Any]) -> str:
    """'/'-joined names of an NNX path or a jax key path (dict keys, attributes, indices)."""
    parts = []
    for p in path:
        name = getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))
        if name != "value":  # nnx.Variable's own pytree attribute
            parts.append(str(name))
    return "/".join(parts)


def param_logical_axes(path: Sequence[Any], ndim: int) -> tuple[str | None, ...]:
    s = path_str(path)
    for pattern, axes in PARAM_RULES:
        if re.search(pattern, s) and len(axes) == ndim:
            return axes
    return (None,) * ndim


def param_partition_spec(path: Sequence[Any], shape: Sequence[int], mesh: Mesh | None = None) -> PartitionSpec:
    """Spec of the variable at NNX ``path`` (e.g. ``('self_attn', 'q_proj', 'kernel')``) with ``shape``.

    Without ``mesh`` the full rule is returned; with it, dimensions that do not divide are replicated.
    """
    return logical_to_spec(param_logical_axes(path, len(shape)), shape, mesh)


def tree_shardings(tree: Any, mesh: Mesh) -> Any:
    """NamedSharding for every leaf of a pytree of parameters (or optimiser state mirroring them)."""

    def one(path, leaf):
        shape = np.shape(leaf)
        return NamedSharding(mesh, param_partition_spec(path, shape, mesh))

    return jax.tree_util.tree_map_with_path(one, tree)


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """device_put that also works when the mesh spans several processes (every process passes the
    same full value; each places the shards its devices own)."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def shard_tree(tree: Any, mesh: Mesh) -> Any:
    return jax.tree.map(put, tree, tree_shardings(tree, mesh))


def shard_module(module: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Places every variable of ``module`` on ``mesh`` by the rules (in place; returns the module)."""
    state = nnx.state(module)
    nnx.update(module, shard_tree(state, mesh))
    return module


def kv_cache_spec(mesh: Mesh | None = None, shape: Sequence[int] | None = None) -> PartitionSpec:
    """KV cache [B, Hkv, S, D]: batch over (data, fsdp), kv heads over model."""
    return logical_to_spec(KV_CACHE_AXES, shape, mesh)


def batch_spec(mesh: Mesh | None = None, shape: Sequence[int] | None = None) -> PartitionSpec:
    """Token batches [B, T]: batch over (data, fsdp)."""
    return logical_to_spec(BATCH_AXES, shape, mesh)
