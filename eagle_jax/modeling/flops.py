"""Model FLOPs of a token's forward, counted from the modules' weights: the training throughput's
utilisation (``training/trainer.py``)."""

from __future__ import annotations

import numpy as np
from flax import nnx

from eagle_jax.config import DrafterConfig, TargetConfig


def matmul_params(module: nnx.Module) -> float:
    """Weights one token multiplies with: every kernel, but of the routed experts of a mixture of experts
    only the fraction a token activates (num_experts_per_tok of n_routed_experts; shared experts are
    plain kernels), plus the router."""
    moe = getattr(getattr(module, "config", None), "moe", None)
    n = 0.0
    for path, leaf in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        size = float(np.prod(leaf.get_value().shape))
        if path[-1] == "kernel" and "experts" in path:
            n += size * moe.num_experts_per_tok / moe.n_routed_experts
        elif path[-1] == "kernel" or path[-2:] == ("gate", "weight"):
            n += size
    return n


def attention_flops(config: TargetConfig | DrafterConfig, keys: float) -> float:
    """Score and value products of one query over ``keys`` keys: 2 x keys x heads x (qk + v head widths)."""
    qk, v = (
        (config.mla.qk_head_dim, config.mla.v_head_dim)
        if config.mla is not None
        else (config.head_dim, config.head_dim)
    )
    return 2 * keys * config.num_heads * (qk + v)
