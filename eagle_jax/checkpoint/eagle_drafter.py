"""EAGLE-3 / 3.1 drafter checkpoints (EAGLE authors', vLLM, SGLang, SpecForge and TorchSpec layouts) <-> ``Drafter``.

Canonical layout: ``fc.weight``, ``fc_norm.{i}.weight`` / ``input_norm.weight``,
``midlayer.*`` for the decoder layer, ``norm.weight``, ``lm_head.weight``, ``d2t`` (offsets, int64) and
``t2d`` (bool). Accepted variants: ``layers.0.*`` for ``midlayer.*``, a ``model.`` prefix on every key
but ``lm_head``, ``draft_id_to_target_id`` for ``d2t``, ``t2d`` absent, both absent when Vd == V, an
``embed_tokens.weight`` of the drafter's own.

The decoder layer's attention is the GQA ``self_attn.{q,k,v,o}_proj`` of the Llama layout or, for MLA
drafters (DeepSeek-V3 / Kimi-K2; ``DrafterConfig.mla``), HF DeepseekV3Attention's
``self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
o_proj}`` with q_a_proj (or q_proj) and kv_a_proj_with_mqa reading the 2H input: the same key map
(``drafter_key`` names the module's own variables), so every variant above applies to both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.checkpoint.hf_target import resolve_dtype
from eagle_jax.checkpoint.hub import resolve_checkpoint
from eagle_jax.checkpoint.module_fill import export_tensors, fill_module
from eagle_jax.checkpoint.tensor_files import CheckpointError, TensorSource, write_safetensors
from eagle_jax.config import AuxConvention, DrafterConfig, check_pair, override_drafter_config
from eagle_jax.modeling.drafter import Drafter
from eagle_jax.modeling.target import Target

_LAYER_PARTS = ("hidden_norm", "input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def drafter_key(path: tuple) -> str:
    """NNX path of a ``Drafter`` variable -> canonical EAGLE key."""
    if path in (("d2t",), ("t2d",)):
        return path[0]
    if path == ("embed_tokens",):
        return "embed_tokens.weight"
    name = ".".join(str(p) for p in path)
    if path[-1] == "kernel":
        name = name[: -len("kernel")] + "weight"
    return "midlayer." + name if path[0] in _LAYER_PARTS else name


def canonical_key(key: str) -> str:
    """Normalises the accepted key variants to the canonical layout."""
    if key.startswith("model."):
        key = key[len("model.") :]
    if key.startswith("layers.0."):
        key = "midlayer." + key[len("layers.0.") :]
    if key == "draft_id_to_target_id":
        key = "d2t"
    return key


def validate_d2t(d2t: np.ndarray, vocab_size: int, where: str) -> np.ndarray:
    """d2t holds offsets; the target ids i + d2t[i] must lie in [0, V) and strictly increase."""
    d2t = np.asarray(d2t).astype(np.int64)
    if d2t.ndim != 1:
        raise CheckpointError(f"{where}: 'd2t' must be 1-D, has shape {list(d2t.shape)}")
    targets = np.arange(d2t.shape[0]) + d2t
    bad = np.nonzero((targets < 0) | (targets >= vocab_size))[0]
    if bad.size:
        i = int(bad[0])
        raise CheckpointError(
            f"{where}: 'd2t' maps draft id {i} to target id {int(targets[i])}, outside [0, {vocab_size}) "
            f"(d2t holds offsets: target_id = draft_id + d2t[draft_id])"
        )
    if np.any(np.diff(targets) <= 0):
        i = int(np.nonzero(np.diff(targets) <= 0)[0][0])
        raise CheckpointError(
            f"{where}: 'd2t' target ids are not strictly increasing at draft id {i + 1} "
            f"({int(targets[i])} then {int(targets[i + 1])})"
        )
    return d2t


def t2d_from_d2t(d2t: np.ndarray, vocab_size: int) -> np.ndarray:
    t2d = np.zeros((vocab_size,), bool)
    t2d[np.arange(d2t.shape[0]) + d2t] = True
    return t2d


def load_drafter(
    path: str | Path,
    target: Target,
    dtype=None,
    *,
    aux_convention: AuxConvention = "input",
    overrides: dict[str, Any] | None = None,
    revision: str | None = None,
) -> Drafter:
    """Loads an EAGLE-3/3.1 drafter checkpoint for ``target`` (which is not modified).

    path: a checkpoint directory, or a Hugging Face Hub repo id fetched into the HF cache at
    ``revision`` (``eagle_jax.checkpoint.hub.resolve_checkpoint``).

    The drafter owns the target layers it reads: ``eagle_aux_hidden_state_layer_ids`` from its config
    (read in ``aux_convention``: "input" = residual stream entering layer i, as the EAGLE code and vLLM;
    "output" = SGLang/SpecForge "output of layer j"), else EAGLE's default for the target's depth; the
    loaded config always names them. ``overrides`` replaces config fields (``DrafterConfig`` names, e.g.
    ``{"norm_output": False}`` for a SpecForge-trained EAGLE-3.1 checkpoint, whose ``norm_output`` means
    something else; aux ids in the 'input' convention). The embedding is the target's unless the
    checkpoint carries ``embed_tokens.weight``.
    """
    path = resolve_checkpoint(path, revision=revision)
    where = str(path / "config.json")
    config = override_drafter_config(DrafterConfig.from_pretrained(path, aux_convention), overrides, where)
    config = config.replace(aux_layer_ids=check_pair(target.config, config, where))
    source = TensorSource(path)
    renamed = {k: canonical_key(k) for k in source.keys()}
    stored = {v: k for k, v in renamed.items()}
    dt = resolve_dtype(dtype, config.dtype, source, stored.get("fc.weight", "fc.weight"))
    if config.fc_norm and not any(k.startswith("fc_norm.") for k in stored):
        raise CheckpointError(f"{path}: config sets fc_norm=true but the checkpoint has no 'fc_norm.*.weight'")

    provided: dict[tuple, object] = {}
    vd, v = config.draft_vocab_size, config.vocab_size
    if "d2t" in stored:
        d2t = validate_d2t(source.get(stored["d2t"]), v, f"{source.file_of(stored['d2t'])}")
        if d2t.shape[0] != vd:
            raise CheckpointError(
                f"{source.file_of(stored['d2t'])}: 'd2t' has {d2t.shape[0]} entries, draft_vocab_size is {vd}"
            )
    elif vd == v:
        d2t = np.zeros((vd,), np.int64)
        provided[("d2t",)] = jnp.zeros((vd,), jnp.int32)
    else:
        # Never invent a mapping: a silent "first Vd ids" default collapses acceptance.
        raise CheckpointError(
            f"{path}: draft_vocab_size={vd} < vocab_size={v} but the checkpoint has no 'd2t' "
            f"(or 'draft_id_to_target_id') mapping"
        )
    t2d = t2d_from_d2t(d2t, v)
    if "t2d" in stored:
        given = np.asarray(source.get(stored["t2d"])).astype(bool)
        if given.shape != (v,) or not np.array_equal(given, t2d):
            raise CheckpointError(f"{source.file_of(stored['t2d'])}: 't2d' disagrees with 'd2t'")
    else:
        provided[("t2d",)] = jnp.asarray(t2d)
    if "embed_tokens.weight" not in stored:
        if target.config.hidden_size != config.hidden_size:
            raise CheckpointError(
                f"{path}: no 'embed_tokens.weight' and the target's embedding width {target.config.hidden_size} "
                f"differs from the drafter's hidden_size {config.hidden_size}"
            )
        provided[("embed_tokens",)] = target.embed_tokens[...].astype(dt)

    abstract = nnx.eval_shape(lambda: Drafter(config, dtype=dt))
    try:
        drafter = fill_module(abstract, source, drafter_key, provided=provided, renamed=renamed)
    finally:
        source.release()
    drafter.set_vocab_map(d2t)
    return drafter


def save_drafter(drafter: Drafter, path: str | Path, dtype=None, *, include_embedding: bool = False) -> None:
    """Writes config.json + model.safetensors in the EAGLE layout PyTorch engines load.

    Keys ``midlayer.*`` (the EAGLE authors' layout). Llama-layout drafters: ``LlamaForCausalLMEagle3``,
    loaded by vLLM (llama_eagle3), SGLang and SpecForge. MLA drafters: a DeepseekV3Config with the MLA
    fields and ``architectures`` as read (``Eagle3DeepseekV2ForCausalLM`` for new ones, the name of the
    released Kimi-K2.x MLA drafters), loaded by vLLM's deepseek_eagle3 (which maps ``midlayer.`` to
    ``layers.0.``) and SGLang's MLA EAGLE-3 models (whose own name is ``midlayer``).

    d2t is written as int64 offsets and t2d as bool (omitted only never: engines expect both when
    Vd < V). The embedding is omitted unless ``include_embedding`` (engines take the target's), and
    always written when ``hidden_size != target_hidden_size``: it cannot be the target's then, and
    without it the checkpoint could not be loaded again.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    out_dtype = drafter.dtype if dtype is None else resolve_dtype(dtype, None, None, "")
    include_embedding = include_embedding or drafter.config.hidden_size != drafter.config.target_hidden_size

    def tensors():
        for key, arr in export_tensors(
            drafter, drafter_key, out_dtype, skip=lambda p: p == ("embed_tokens",) and not include_embedding
        ):
            yield key, (arr.astype(np.int64) if key == "d2t" else arr)

    write_safetensors(path / "model.safetensors", tensors())
    hf = drafter.config.replace(dtype=jnp.dtype(out_dtype).name).to_hf()
    tmp = path / "config.json.tmp"
    tmp.write_text(json.dumps(hf, indent=2) + "\n")
    tmp.replace(path / "config.json")
