"""Malformed, incomplete or mismatched checkpoints fail with an error that names the culprit.

Each test starts from a valid tiny checkpoint (a drafter written with ``save_drafter``, a target with
``save_target``), introduces one defect by editing config.json or rewriting the safetensors file, and
checks the error type and that the message names the offending key, field or file.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

import eagle_jax
import eagle_jax.checkpoint.eagle_drafter as eagle_drafter_module
from eagle_jax import CheckpointError, ConfigError, Drafter, DrafterConfig, Target, TargetConfig
from eagle_jax.checkpoint.tensor_files import TensorSource, write_safetensors

V, VD, H, LAYERS = 64, 48, 32, 4


def make_target() -> Target:
    config = TargetConfig(
        architecture="llama",
        vocab_size=V,
        hidden_size=H,
        intermediate_size=64,
        num_layers=LAYERS,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    return Target(config)


def make_drafter(target: Target, seed: int = 0) -> Drafter:
    config = DrafterConfig(
        hidden_size=H,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=V,
        draft_vocab_size=VD,
        target_hidden_size=H,
        num_aux_hidden_states=3,
    )
    drafter = Drafter(config, target.embed_tokens[...], rngs=nnx.Rngs(seed))
    used = np.sort(np.random.default_rng(seed).choice(V, VD, replace=False))
    drafter.set_vocab_map(used - np.arange(VD))  # d2t holds offsets
    return drafter


@pytest.fixture(scope="module")
def target() -> Target:
    return make_target()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, target):
    """Valid checkpoints written once: {"drafter": dir, "target": dir}."""
    root = tmp_path_factory.mktemp("valid")
    eagle_jax.save_drafter(make_drafter(target), root / "drafter")
    eagle_jax.save_target(target, root / "target")
    return {"drafter": root / "drafter", "target": root / "target"}


@pytest.fixture
def drafter_dir(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved["drafter"], tmp_path / "drafter"))


@pytest.fixture
def target_dir(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved["target"], tmp_path / "target"))


def edit_config(directory: Path, **fields) -> None:
    """Sets (or, for value None, removes) top-level config.json fields."""
    file = directory / "config.json"
    cfg = json.loads(file.read_text())
    for key, value in fields.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    file.write_text(json.dumps(cfg))


def edit_tensors(directory: Path, edit) -> None:
    """Reads model.safetensors into memory, applies ``edit(dict)`` and writes it back."""
    source = TensorSource(directory)
    tensors = {k: np.array(source.get(k)) for k in source.keys()}
    source.release()
    edit(tensors)
    write_safetensors(directory / "model.safetensors", tensors)


def load_drafter(directory: Path, **kw):
    return eagle_jax.load_drafter(directory, make_target(), **kw)


def test_valid_checkpoints_load(saved, target):
    """The unmodified checkpoints load: every failure below comes from its one defect."""
    drafter = eagle_jax.load_drafter(saved["drafter"], make_target())
    assert drafter.config.draft_vocab_size == VD
    loaded = eagle_jax.load_target(saved["target"])
    assert loaded.config == target.config.replace(dtype="float32")


# ------------------------------------------------------------------------------------ tensor set/shape


@pytest.mark.parametrize("kind", ["drafter", "target"])
def test_missing_tensor(kind, drafter_dir, target_dir):
    key = {"drafter": "midlayer.mlp.up_proj.weight", "target": "model.layers.1.mlp.up_proj.weight"}[kind]
    directory = drafter_dir if kind == "drafter" else target_dir
    edit_tensors(directory, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing tensor") as e:
        load_drafter(directory) if kind == "drafter" else eagle_jax.load_target(directory)
    assert f"'{key}'" in str(e.value)


@pytest.mark.parametrize("kind", ["drafter", "target"])
def test_unexpected_tensor(kind, drafter_dir, target_dir):
    key = {"drafter": "midlayer.mlp.extra_proj.weight", "target": "model.layers.9.mlp.up_proj.weight"}[kind]
    directory = drafter_dir if kind == "drafter" else target_dir
    edit_tensors(directory, lambda t: t.__setitem__(key, np.zeros((4, 4), np.float32)))
    with pytest.raises(CheckpointError, match="unexpected tensor") as e:
        load_drafter(directory) if kind == "drafter" else eagle_jax.load_target(directory)
    assert key in str(e.value) and "model.safetensors" in str(e.value)


@pytest.mark.parametrize("kind", ["drafter", "target"])
def test_wrong_shape(kind, drafter_dir, target_dir):
    key, shape = {"drafter": ("fc.weight", (H, 3 * H + 1)), "target": ("model.norm.weight", (H + 1,))}[kind]
    directory = drafter_dir if kind == "drafter" else target_dir
    edit_tensors(directory, lambda t: t.__setitem__(key, np.zeros(shape, np.float32)))
    with pytest.raises(CheckpointError, match="shape") as e:
        load_drafter(directory) if kind == "drafter" else eagle_jax.load_target(directory)
    msg = str(e.value)
    assert f"'{key}'" in msg and str(list(shape)) in msg and "model.safetensors" in msg


# --------------------------------------------------------------------------------------- vocab maps


def test_d2t_out_of_range(drafter_dir):
    def edit(t):
        t["d2t"][-1] += V  # last draft id -> target id >= V

    edit_tensors(drafter_dir, edit)
    with pytest.raises(CheckpointError, match=r"'d2t'.*outside \[0, 64\)") as e:
        load_drafter(drafter_dir)
    assert f"draft id {VD - 1}" in str(e.value)


def test_d2t_not_increasing(drafter_dir):
    def edit(t):
        d2t = t["d2t"]
        targets = np.arange(VD) + d2t
        targets[[10, 11]] = targets[[11, 10]]  # still a permutation of valid ids, but out of order
        t["d2t"] = targets - np.arange(VD)

    edit_tensors(drafter_dir, edit)
    with pytest.raises(CheckpointError, match=r"'d2t'.*not strictly increasing at draft id 11"):
        load_drafter(drafter_dir)


def test_t2d_disagrees_with_d2t(drafter_dir):
    def edit(t):
        t2d = t["t2d"]
        t2d[int(np.nonzero(~t2d)[0][0])] = True  # one target id too many

    edit_tensors(drafter_dir, edit)
    with pytest.raises(CheckpointError, match=r"'t2d' disagrees with 'd2t'"):
        load_drafter(drafter_dir)


def test_reduced_vocab_without_d2t(drafter_dir):
    """Vd < V and no mapping: the loader must refuse rather than invent "the first Vd ids"."""
    edit_tensors(drafter_dir, lambda t: (t.pop("d2t"), t.pop("t2d")))
    with pytest.raises(CheckpointError, match=r"draft_vocab_size=48 < vocab_size=64.*'d2t'"):
        load_drafter(drafter_dir)


# ------------------------------------------------------------------------------------------ aux ids


@pytest.mark.parametrize("where", ["top_level", "eagle_config"])
@pytest.mark.parametrize(
    "ids,convention,pattern",
    [
        ([1, 2, LAYERS], "input", rf"\[{LAYERS}\] out of range for a target with {LAYERS} layers"),
        ([-1, 1, 2], "input", r"\[-1\] out of range"),
        ([1, 2, LAYERS - 1], "output", rf"\[{LAYERS}\] out of range"),  # output j = entering j + 1
        ([1, 2, 2], "input", r"duplicated"),
    ],
    ids=["too_high", "negative", "too_high_output_convention", "duplicated"],
)
def test_bad_aux_layer_ids(where, ids, convention, pattern, drafter_dir):
    if where == "top_level":
        edit_config(drafter_dir, eagle_aux_hidden_state_layer_ids=ids)
    else:
        edit_config(drafter_dir, eagle_config={"eagle_aux_hidden_state_layer_ids": ids})
    with pytest.raises(ConfigError, match=pattern) as e:
        load_drafter(drafter_dir, aux_convention=convention)
    assert str(drafter_dir / "config.json") in str(e.value)


def test_num_aux_disagrees_with_aux_ids(drafter_dir):
    edit_config(drafter_dir, num_aux_hidden_states=2, eagle_aux_hidden_state_layer_ids=[1, 2, 3])
    with pytest.raises(ConfigError, match=r"num_aux_hidden_states=2 but eagle_aux_hidden_state_layer_ids has 3") as e:
        load_drafter(drafter_dir)
    assert "config.json" in str(e.value)


def test_num_aux_disagrees_with_target(drafter_dir):
    """No ids in the checkpoint: the target's default 3 aux layers must match num_aux_hidden_states."""
    edit_config(drafter_dir, num_aux_hidden_states=2)
    with pytest.raises(ConfigError, match=r"num_aux_hidden_states=2 but it reads 3 target layers"):
        load_drafter(drafter_dir)


# ------------------------------------------------------------------------------- drafter/target pair


def test_drafter_vocab_differs_from_target(drafter_dir):
    edit_config(drafter_dir, vocab_size=100)
    with pytest.raises(ConfigError, match=r"vocab_size=100 but the target's is 64") as e:
        load_drafter(drafter_dir)
    assert "config.json" in str(e.value)


def test_drafter_target_hidden_size_differs(drafter_dir):
    edit_config(drafter_dir, target_hidden_size=48)
    with pytest.raises(ConfigError, match=r"target_hidden_size=48 but the target's hidden_size is 32"):
        load_drafter(drafter_dir)


def test_fc_norm_with_norm_before_fc(drafter_dir):
    edit_config(drafter_dir, fc_norm=True, norm_before_fc=True)
    with pytest.raises(ConfigError, match=r"'fc_norm' and 'norm_before_fc' are mutually exclusive") as e:
        load_drafter(drafter_dir)
    assert "config.json" in str(e.value)


# ------------------------------------------------------------------------------------------- configs


def test_unsupported_architecture(target_dir):
    edit_config(target_dir, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ConfigError, match="unsupported architecture.*GPT2LMHeadModel") as e:
        eagle_jax.load_target(target_dir)
    assert "config.json" in str(e.value)


def test_unsupported_target_rope_type(target_dir):
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4, "factor": 2.0}
    edit_config(target_dir, rope_scaling=rope)
    with pytest.raises(ConfigError, match="unsupported rope type 'longrope'") as e:
        eagle_jax.load_target(target_dir)
    assert "config.json" in str(e.value)


def test_unsupported_drafter_rope_type(drafter_dir):
    """Drafters only use default / linear / dynamic RoPE (v5 dialect field here)."""
    edit_config(drafter_dir, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(ConfigError, match="unsupported rope type 'yarn'"):
        load_drafter(drafter_dir)


MLA_FIELDS = {"q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}


@pytest.mark.parametrize(
    "fields, pattern",
    [
        # An MLA drafter's name without its MLA fields.
        ({"architectures": ["Eagle3DeepseekV2ForCausalLM"]}, "required field 'q_lora_rank' is missing"),
        (
            {"architectures": ["DeepseekV3ForCausalLMEagle3"], "q_lora_rank": 8},
            "required field 'kv_lora_rank' is missing",
        ),
        (
            {"architectures": ["Eagle3DeepseekV3ForCausalLM"], **MLA_FIELDS, "qk_rope_head_dim": 5},
            "'qk_rope_head_dim'=5 must be even",
        ),
    ],
)
def test_bad_mla_drafter_config(fields, pattern, drafter_dir):
    cfg = json.loads((drafter_dir / "config.json").read_text())
    (drafter_dir / "config.json").write_text(json.dumps({**cfg, **fields}))
    with pytest.raises(ConfigError, match=pattern) as e:
        load_drafter(drafter_dir)
    assert "config.json" in str(e.value)


def test_mla_config_on_a_gqa_checkpoint(drafter_dir):
    """A valid MLA config.json over Llama-layout weights: the first MLA tensor is missing, by name."""
    edit_config(
        drafter_dir,
        architectures=["Eagle3DeepseekV2ForCausalLM"],
        **{k: v for k, v in MLA_FIELDS.items() if v is not None},
    )
    cfg = json.loads((drafter_dir / "config.json").read_text())
    (drafter_dir / "config.json").write_text(json.dumps({**cfg, "q_lora_rank": None}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['midlayer.self_attn.(k|q|v)_proj.weight'"):
        load_drafter(drafter_dir)


@pytest.mark.parametrize("kind", ["drafter", "target"])
def test_missing_config_json(kind, drafter_dir, target_dir):
    directory = drafter_dir if kind == "drafter" else target_dir
    (directory / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json") as e:
        load_drafter(directory) if kind == "drafter" else eagle_jax.load_target(directory)
    assert str(directory / "config.json") in str(e.value)


# ------------------------------------------------------------------------------------------- files


def test_malformed_safetensors_header(drafter_dir):
    file = drafter_dir / "model.safetensors"
    body = b"{this is not json" + b" " * 15
    file.write_bytes(struct.pack("<Q", len(body)) + body + b"\0" * 64)
    with pytest.raises(CheckpointError, match="header is not valid JSON") as e:
        load_drafter(drafter_dir)
    assert str(file) in str(e.value)


def test_header_length_past_end_of_file(drafter_dir):
    file = drafter_dir / "model.safetensors"
    file.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(CheckpointError, match="header length .* exceeds the file size") as e:
        load_drafter(drafter_dir)
    assert str(file) in str(e.value)


def test_truncated_safetensors(drafter_dir):
    """Cut inside the data of the last tensor: reported when that tensor is read, naming it."""
    file = drafter_dir / "model.safetensors"
    raw = file.read_bytes()
    file.write_bytes(raw[:-7])
    with pytest.raises(CheckpointError, match=r"tensor '.*' lies past the end of the file \(truncated\?\)") as e:
        load_drafter(drafter_dir)
    assert str(file) in str(e.value)


def test_safetensors_shorter_than_its_header_length(drafter_dir):
    file = drafter_dir / "model.safetensors"
    file.write_bytes(file.read_bytes()[:5])
    with pytest.raises(CheckpointError, match="truncated safetensors file") as e:
        load_drafter(drafter_dir)
    assert str(file) in str(e.value)


def test_sharded_index_names_missing_shard(drafter_dir):
    source = TensorSource(drafter_dir)
    tensors = {k: np.array(source.get(k)) for k in source.keys()}
    source.release()
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, names in shards.items():
        write_safetensors(drafter_dir / name, {k: tensors[k] for k in names})
    index = {"metadata": {}, "weight_map": {k: name for name, names in shards.items() for k in names}}
    (drafter_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    (drafter_dir / "model.safetensors").unlink()
    load_drafter(drafter_dir)  # the sharded copy is valid
    (drafter_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="lists shard 'model-00002-of-00002.safetensors', which is missing") as e:
        load_drafter(drafter_dir)
    assert "model.safetensors.index.json" in str(e.value)


# ---------------------------------------------------------------------------------- atomic save


def test_failed_save_drafter_keeps_old_checkpoint(drafter_dir, target, monkeypatch):
    """save_drafter over a valid checkpoint that fails mid-way leaves the old files intact and loadable."""
    old_weights = (drafter_dir / "model.safetensors").read_bytes()
    old_config = (drafter_dir / "config.json").read_text()
    real_export = eagle_drafter_module.export_tensors

    def failing_export(*args, **kwargs):
        for i, item in enumerate(real_export(*args, **kwargs)):
            if i == 3:
                raise OSError("simulated failure while writing tensors")
            yield item

    monkeypatch.setattr(eagle_drafter_module, "export_tensors", failing_export)
    other = make_drafter(target, seed=1)  # different weights: an overwrite would show
    with pytest.raises(OSError, match="simulated failure"):
        eagle_jax.save_drafter(other, drafter_dir)
    assert (drafter_dir / "model.safetensors").read_bytes() == old_weights
    assert (drafter_dir / "config.json").read_text() == old_config
    assert sorted(p.name for p in drafter_dir.iterdir()) == ["config.json", "model.safetensors"]
    load_drafter(drafter_dir)


def test_failed_write_leaves_no_partial_file(drafter_dir, target, monkeypatch):
    """A failure after the temporary file was written (here: the final rename) keeps the old file and
    removes the temporary one (a half-written multi-GB .tmp would otherwise be left on disk)."""
    import eagle_jax.checkpoint.tensor_files as tensor_files

    old_weights = (drafter_dir / "model.safetensors").read_bytes()

    def failing_replace(src, dst):
        assert Path(src).exists()
        raise OSError("simulated failure at rename")

    monkeypatch.setattr(tensor_files.os, "replace", failing_replace)
    with pytest.raises(OSError, match="simulated failure at rename"):
        eagle_jax.save_drafter(make_drafter(target, seed=1), drafter_dir)
    monkeypatch.undo()
    assert (drafter_dir / "model.safetensors").read_bytes() == old_weights
    assert not list(drafter_dir.glob("*.tmp"))
    load_drafter(drafter_dir)
