"""Model FLOPs of a token's forward, counted from the modules' weights: the training throughput's
utilisation (``training/trainer.py``) and the drafter's share of a prefill that ``spec="auto"`` charges
speculation with (``decoding/autospec.py``)."""

from __future__ import annotations

from typing import Callable

import numpy as np
from flax import nnx

from eagle_jax.config import DrafterConfig, TargetConfig
from eagle_jax.modeling.drafter import Drafter
from eagle_jax.modeling.target import Target

# The attention projections a drafter's prompt pair goes through (``Drafter.write_cache``): keys and values
# (grouped-query attention), or the latent and the rope key (MLA)
KEY_VALUE_PROJECTIONS = ("k_proj", "v_proj", "kv_a_proj_with_mqa")


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
    qk, v = (config.mla.qk_head_dim, config.mla.v_head_dim) if config.mla is not None else (config.head_dim, config.head_dim)
    return 2 * keys * config.num_heads * (qk + v)


def prefill_drafter_share(target: Target, drafter: Drafter) -> Callable[[int], float]:
    """The drafter's share of a prefill's FLOPs, by the prompts' length (the weights counted once). Per prompt
    position the target runs every layer (its causal attention included; the lm_head at the last position only)
    and the drafter only ``fc`` and the key/value projections of its pair (``Drafter.write_cache``): its layer's
    outputs are computed at the last position only, so its share is a few percent (the bundled pair: 2-3%), far
    below its share of a decoding round."""
    lm_head = target.lm_head  # None where tied to the embedding
    weights = 2 * (matmul_params(target) - (matmul_params(lm_head) if lm_head is not None else 0.0))
    attn = drafter.self_attn
    mine = 2 * (matmul_params(drafter.fc) + sum(matmul_params(getattr(attn, n)) for n in KEY_VALUE_PROJECTIONS if hasattr(attn, n)))
    config = target.config

    def share(prompt_len: int) -> float:
        theirs = weights + attention_flops(config, (prompt_len + 1) / 2) * config.num_layers
        return mine / (mine + theirs)

    return share
