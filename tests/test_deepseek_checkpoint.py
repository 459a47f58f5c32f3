"""DeepSeek-V3 / Kimi-K2 configs and checkpoints: what loads, and errors that name the field or tensor.

Each checkpoint test starts from a valid tiny MLA + MoE target written with ``save_target`` (experts
one tensor each, as transformers writes them) and introduces one defect.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from engine_models import deepseek_config
from flax import nnx

import eagle_jax
from eagle_jax import CheckpointError, ConfigError, Target, TargetConfig
from eagle_jax.checkpoint.tensor_files import TensorSource, write_safetensors
from eagle_jax.config import MLAConfig, MoEConfig

IDS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)), jnp.int32)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Target]:
    target = Target(deepseek_config(64, 64), rngs=nnx.Rngs(3))
    path = tmp_path_factory.mktemp("deepseek") / "ckpt"
    eagle_jax.save_target(target, path)
    return path, target


def copy_with(saved_path: Path, dst: Path, config: dict | None = None, tensors=None) -> Path:
    """A copy of the checkpoint with config.json fields updated and the tensors rewritten by ``tensors(dict)``."""
    shutil.copytree(saved_path, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        src = TensorSource(saved_path)
        items = {k: np.array(src.get(k)) for k in src.keys()}
        write_safetensors(dst / "model.safetensors", tensors(items))
    return dst


def test_round_trip_is_exact(saved):
    path, target = saved
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and "head_dim" not in config
    keys = TensorSource(path).keys()
    assert (
        "model.layers.1.mlp.experts.7.gate_proj.weight" in keys
        and "model.layers.1.mlp.experts.gate_proj.weight" not in keys
    )
    loaded = eagle_jax.load_target(path)
    assert loaded.config == target.config.replace(dtype="float32")
    assert loaded.layers[1].mlp.gate.e_score_correction_bias[...].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(loaded(IDS)[0]), np.asarray(target(IDS)[0]))


def test_bf16_load_keeps_the_selection_bias_fp32(saved):
    loaded = eagle_jax.load_target(saved[0], dtype="bfloat16")
    assert loaded.layers[1].mlp.experts.gate_proj.kernel[...].dtype == jnp.bfloat16
    assert loaded.layers[1].mlp.gate.e_score_correction_bias[...].dtype == jnp.float32


@pytest.mark.parametrize(
    "change,field",
    [
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 4}, "topk_group"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"kv_lora_rank": None}, "kv_lora_rank"),
        ({"n_routed_experts": None}, "n_routed_experts"),
        (
            {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized"}},
            "quantization_config",
        ),
    ],
)
def test_config_errors_name_the_field(saved, tmp_path, change, field):
    bad = copy_with(saved[0], tmp_path / "bad", config=change)
    with pytest.raises(ConfigError, match=field) as e:
        eagle_jax.load_target(bad)
    assert "config.json" in str(e.value)


def test_missing_q_lora_rank_is_an_error_not_a_default(saved, tmp_path):
    cfg = json.loads((saved[0] / "config.json").read_text())
    del cfg["q_lora_rank"]
    with pytest.raises(ConfigError, match="q_lora_rank"):
        TargetConfig.from_hf(cfg)


def test_direct_config_validation():
    with pytest.raises(ConfigError, match="n_routed_experts=6 is not a multiple of n_group=4"):
        MoEConfig(n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=8, n_group=4)
    with pytest.raises(ConfigError, match="'v_head_dim'=0"):
        MLAConfig(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=0)
    c = deepseek_config(64, 64)
    with pytest.raises(ConfigError, match="head_dim=16 must be qk_nope_head_dim"):
        c.replace(head_dim=16)
    with pytest.raises(ConfigError, match="deepseek_v3 has both 'mla' and 'moe'"):
        c.replace(moe=None)


def test_missing_expert_is_named(saved, tmp_path):
    gone = "model.layers.2.mlp.experts.5.up_proj.weight"
    bad = copy_with(saved[0], tmp_path / "bad", tensors=lambda d: {k: v for k, v in d.items() if k != gone})
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight'"):
        eagle_jax.load_target(bad)


def test_expert_beyond_n_routed_experts_is_unexpected(saved, tmp_path):
    extra = "model.layers.1.mlp.experts.8.down_proj.weight"
    bad = copy_with(
        saved[0], tmp_path / "bad", tensors=lambda d: {**d, extra: d["model.layers.1.mlp.experts.0.down_proj.weight"]}
    )
    with pytest.raises(CheckpointError, match=r"unexpected tensors .*experts\.8\.down_proj"):
        eagle_jax.load_target(bad)


def test_wrong_expert_shape_is_named(saved, tmp_path):
    key = "model.layers.1.mlp.experts.3.gate_proj.weight"
    bad = copy_with(saved[0], tmp_path / "bad", tensors=lambda d: {**d, key: d[key][:, :-1]})
    with pytest.raises(
        CheckpointError, match="experts of 'model.layers.1.mlp.experts.gate_proj.weight' differ in shape"
    ):
        eagle_jax.load_target(bad)


def test_multi_token_prediction_layers_are_skipped(saved, tmp_path):
    """DeepSeek-V3 stores its MTP module as layer L (num_nextn_predict_layers=1): ignored, as by HF;
    the same tensors without that field are unexpected."""
    path, target = saved
    mtp = {
        "model.layers.3.eh_proj.weight": np.zeros((64, 128), np.float32),
        "model.layers.3.enorm.weight": np.ones(64, np.float32),
    }
    with_mtp = copy_with(path, tmp_path / "mtp", config={"num_nextn_predict_layers": 1}, tensors=lambda d: {**d, **mtp})
    np.testing.assert_array_equal(np.asarray(eagle_jax.load_target(with_mtp)(IDS)[0]), np.asarray(target(IDS)[0]))
    no_field = copy_with(path, tmp_path / "no_field", tensors=lambda d: {**d, **mtp})
    with pytest.raises(CheckpointError, match="model.layers.3.e"):
        eagle_jax.load_target(no_field)


def quantize_blocks(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float32 -> (float8 e4m3 weight, float32 scale per block), the published checkpoints' scheme."""
    rows, cols = w.shape
    grid = (-(-rows // block), -(-cols // block))
    padded = np.zeros((grid[0] * block, grid[1] * block), np.float32)
    padded[:rows, :cols] = w
    blocks = padded.reshape(grid[0], block, grid[1], block)
    scale = np.maximum(np.abs(blocks).max(axis=(1, 3)), 1e-12) / 448.0  # 448: float8 e4m3's largest value
    q = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:rows, :cols].astype(ml_dtypes.float8_e4m3fn)
    return q, scale.astype(np.float32)


def test_block_fp8_checkpoint_is_dequantized(saved, tmp_path):
    """Every decoder linear (experts included) stored as FP8 with 16x16 block scales, some shapes not
    multiples of 16 (kv_a_proj_with_mqa: 40 rows): loads as the dequantized weights
    ``fp8 * scale[row // 16, col // 16]``, with the same logits as a float32 checkpoint of those."""
    path, _ = saved
    dequantized: dict[str, np.ndarray] = {}

    def quantize(d):
        out = {}
        for k, w in d.items():
            if w.ndim == 2 and ".layers." in k and "norm" not in k and ".mlp.gate." not in k:
                q, scale = quantize_blocks(w, 16)
                out[k], out[k + "_scale_inv"] = q, scale
                full = np.repeat(np.repeat(scale, 16, axis=0), 16, axis=1)[: w.shape[0], : w.shape[1]]
                dequantized[k] = q.astype(np.float32) * full
            else:
                out[k] = w
        return out

    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    fp8 = copy_with(path, tmp_path / "fp8", tensors=quantize, config={"quantization_config": quantization})
    assert TensorSource(fp8).shape("model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv") == (3, 4)
    plain = copy_with(path, tmp_path / "plain", tensors=lambda d: {**d, **dequantized})
    a, b = eagle_jax.load_target(fp8), eagle_jax.load_target(plain)
    kernel = np.asarray(a.layers[0].self_attn.kv_a_proj_with_mqa.kernel[...])
    np.testing.assert_array_equal(kernel, dequantized["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].T)
    np.testing.assert_array_equal(np.asarray(a(IDS)[0]), np.asarray(b(IDS)[0]))
    bad = copy_with(
        fp8, tmp_path / "bad", config={"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}}
    )
    with pytest.raises(CheckpointError, match=r"_scale_inv' has shape \[\d+, \d+\], expected"):
        eagle_jax.load_target(bad)
