"""The logical -> mesh axis rules of eagle_jax.sharding (shapes only; placement runs in test_training)."""

from __future__ import annotations

import jax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from eagle_jax import Drafter, DrafterConfig, Target, TargetConfig
from eagle_jax.sharding import batch_spec, kv_cache_spec, make_mesh, param_partition_spec, shard_module, tree_shardings

MESH = AbstractMesh((2, 2, 2), ("data", "fsdp", "model"))
EP_MESH = AbstractMesh((2, 2, 2, 2), ("data", "fsdp", "expert", "model"))


def test_rules_per_parameter():
    cases = {
        ("layers", 0, "self_attn", "q_proj", "kernel"): ((64, 128), P("fsdp", "model")),
        ("self_attn", "k_proj", "kernel"): ((128, 32), P("fsdp", "model")),
        ("layers", 1, "self_attn", "v_proj", "bias"): ((32,), P("model")),
        ("layers", 0, "self_attn", "o_proj", "kernel"): ((128, 64), P("model", "fsdp")),
        ("mlp", "gate_proj", "kernel"): ((64, 256), P("fsdp", "model")),
        ("layers", 3, "mlp", "up_proj", "kernel"): ((64, 256), P("fsdp", "model")),
        ("mlp", "down_proj", "kernel"): ((256, 64), P("model", "fsdp")),
        ("embed_tokens",): ((1000, 64), P("model", "fsdp")),
        ("lm_head", "kernel"): ((64, 1000), P("fsdp", "model")),
        ("fc", "kernel"): ((192, 64), P("model", "fsdp")),
        ("norm", "weight"): ((64,), P(None)),
        ("fc_norm", 0, "weight"): ((64,), P(None)),
        ("layers", 0, "self_attn", "q_norm", "weight"): ((16,), P(None)),
        ("d2t",): ((500,), P(None)),
        ("t2d",): ((1000,), P(None)),
        # DeepSeek-V3: MLA up-projections over heads, latents replicated; router replicated
        ("layers", 3, "mlp", "shared_experts", "up_proj", "kernel"): ((64, 32), P("fsdp", "model")),
        ("layers", 3, "mlp", "gate", "weight"): ((8, 64), P(None, None)),
        ("layers", 3, "mlp", "gate", "e_score_correction_bias"): ((8,), P(None)),
        ("layers", 0, "self_attn", "q_a_proj", "kernel"): ((64, 48), P("fsdp", None)),
        ("layers", 0, "self_attn", "q_b_proj", "kernel"): ((48, 96), P(None, "model")),
        ("layers", 0, "self_attn", "kv_a_proj_with_mqa", "kernel"): ((64, 40), P("fsdp", None)),
        ("layers", 0, "self_attn", "kv_b_proj", "kernel"): ((32, 128), P(None, "model")),
    }
    for path, (shape, want) in cases.items():
        assert param_partition_spec(path, shape, MESH) == want, path
        assert param_partition_spec(path, shape) == want, path  # without a mesh: the rule itself


def test_expert_rules():
    """Routed experts [E, in, out]: experts over "expert" (a mesh without that axis leaves them whole),
    their hidden units over "model"."""
    gate, down = (
        ("layers", 3, "mlp", "experts", "gate_proj", "kernel"),
        ("layers", 3, "mlp", "experts", "down_proj", "kernel"),
    )
    assert param_partition_spec(gate, (8, 64, 32)) == P("expert", "fsdp", "model")
    assert param_partition_spec(gate, (8, 64, 32), EP_MESH) == P("expert", "fsdp", "model")
    assert param_partition_spec(down, (8, 32, 64), EP_MESH) == P("expert", "model", "fsdp")
    assert param_partition_spec(gate, (8, 64, 32), MESH) == P(None, "fsdp", "model")
    assert param_partition_spec(gate, (7, 64, 32), EP_MESH) == P(None, "fsdp", "model")  # 7 experts do not split in 2
    assert kv_cache_spec(EP_MESH, (8, 1, 128, 512)) == P(("data", "fsdp"), None, None, None)  # the MLA latent cache


def test_non_dividing_dims_fall_back_to_replication():
    assert param_partition_spec(("lm_head", "kernel"), (64, 1001), MESH) == P("fsdp", None)
    assert param_partition_spec(("embed_tokens",), (1001, 63), MESH) == P(None, None)
    small = AbstractMesh((1, 1, 4), ("data", "fsdp", "model"))
    # 2 kv heads x 8 = 16 columns split 4 ways is fine; 6 columns are not.
    assert param_partition_spec(("self_attn", "k_proj", "kernel"), (64, 16), small) == P(None, "model")
    assert param_partition_spec(("self_attn", "k_proj", "kernel"), (64, 6), small) == P(None, None)


def test_optimizer_state_paths_follow_the_parameter_rules():
    import jax.numpy as jnp
    import optax

    params = {"self_attn": {"q_proj": {"kernel": jnp.zeros((4, 8))}}, "norm": {"weight": jnp.zeros((4,))}}
    state = optax.adamw(1e-3).init(params)
    mesh = make_mesh(1, 1, 1)
    for path, sh in jax.tree_util.tree_flatten_with_path(tree_shardings(state, mesh))[0]:
        assert sh.spec in (P(), P(None), P(None, None)), path  # a 1-device mesh shards nothing
    specs = jax.tree_util.tree_flatten_with_path(
        jax.tree_util.tree_map_with_path(lambda p, x: param_partition_spec(p, x.shape), state)
    )[0]
    named = {jax.tree_util.keystr(p): s for p, s in specs}
    assert named["[0].mu['self_attn']['q_proj']['kernel']"] == P("fsdp", "model")
    assert named["[0].count"] == P()


def test_cache_and_batch_specs():
    assert kv_cache_spec() == P(("data", "fsdp"), "model", None, None)  # head-major [B, Hkv, S, D]
    assert batch_spec() == P(("data", "fsdp"), None)
    assert kv_cache_spec(MESH, (8, 2, 128, 16)) == P(("data", "fsdp"), "model", None, None)
    assert kv_cache_spec(MESH, (2, 1, 128, 16)) == P(None, None, None, None)
    assert batch_spec(AbstractMesh((1, 1, 2), ("data", "fsdp", "model")), (4, 16)) == P(None, None)


def test_make_mesh_and_shard_module_on_one_device():
    with pytest.raises(ValueError, match="2 devices, but 1 are given"):
        make_mesh(data=2)
    mesh = make_mesh()
    assert mesh.axis_names == ("data", "fsdp", "model")
    target = Target(
        TargetConfig(
            "llama",
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
            head_dim=8,
        )
    )
    shard_module(target, mesh)
    drafter = shard_module(Drafter(DrafterConfig(16, 2, 1, 8, 32, 64, 32, 16)), mesh)
    for module in (target, drafter):
        for leaf in jax.tree.leaves(nnx.state(module)):
            assert leaf.sharding.mesh.axis_names == ("data", "fsdp", "model")
