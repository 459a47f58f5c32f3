"""The training recipe: its config and what it builds.

Config: a nested dict (YAML recipe, ``configs/train/*.yaml``) merged over ``DEFAULTS``, then
``--set key.sub=value`` overrides; unknown keys are errors. From it: the distributed runtime, the device
mesh, the target (a checkpoint through ``eagle_jax.load_target``, or a seeded random one), the samples
(tokenized JSONL through ``eagle_jax.load_tokenizer``, or the target's greedy continuations), the drafter
with its vocabulary map, and the optimiser. ``eagle_jax.training.trainer`` runs the loop over them.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import nnx

import eagle_jax
from eagle_jax.checkpoint.eagle_drafter import load_drafter
from eagle_jax.checkpoint.hf_target import DTYPES
from eagle_jax.checkpoint.tokenizer import load_tokenizer
from eagle_jax.config import (
    ConfigError,
    DrafterConfig,
    MLAConfig,
    MoEConfig,
    RopeConfig,
    TargetConfig,
    check_pair,
    default_aux_layer_ids,
)
from eagle_jax.modeling.drafter import Drafter
from eagle_jax.modeling.target import Target
from eagle_jax.sharding import make_mesh
from eagle_jax.training.data import BATCHING_MODES, Sample, greedy_samples, load_samples
from eagle_jax.training.features import draft_vocab_head
from eagle_jax.training.ttt import NORMALIZATIONS
from eagle_jax.training.vocab_map import build_vocab_map, coverage, load_vocab_map, token_counts

DEFAULTS: dict[str, Any] = {
    "run_dir": "runs/ttt",
    "seed": 0,
    "target": {
        # an HF checkpoint directory or Hub repo id, a .gguf file, or a named model (smollm2-135m-instruct)
        "path": None,
        # or TargetConfig fields of a randomly initialised target (tiny recipes, tests): a llama unless
        # architecture: deepseek_v3, with mla / moe / rope given as dicts of MLAConfig / MoEConfig / RopeConfig fields
        "random": None,
        "dtype": "float32",
    },
    "drafter": {
        "init": None,  # an EAGLE drafter checkpoint to start from; else fresh weights
        "aux_layer_ids": None,  # target layers read (entering layer i); None = EAGLE's (2, L//2, L-3)
        # null = the target's kind: MLA (the target's MLA sizes and rope, YaRN included) for a DeepSeek-V3 /
        # Kimi-K2 target, GQA otherwise; "gqa" = a Llama-layout drafter on any target; "mla" = MLA (needs an MLA target)
        "attention": None,
        "hidden_size": None,  # None = the target's
        "num_heads": None,
        "num_kv_heads": None,  # GQA only
        "head_dim": None,  # GQA only
        "intermediate_size": None,
        "draft_vocab_size": None,  # None = the target's vocabulary (identity map)
        "vocab_map": None,  # .npz from train.vocab_map; None with Vd < V = built from the training data
        "rope_theta": None,  # None = the target's theta
        "fc_norm": False,  # EAGLE-3.1
        "norm_output": False,  # EAGLE-3.1
        "rms_norm_eps": None,
        # parts of a fresh drafter started from the target (WARM_STARTS): lm_head = the target's output rows of the
        # draft vocabulary, norm = its final norm, fc = the fused feature starting as the last aux state
        "warm_start": [],
    },
    "data": {
        "path": None,  # JSONL file(s): chat / ShareGPT / text records
        "tokenizer": None,  # None = target.path's (a directory, Hub repo id, .gguf file or named model)
        "max_length": 2048,
        # pad: one sample per row, padded to max_length | bucket: one per row, padded to the smallest of
        # `buckets` holding it | pack: several samples per row of max_length (first-fit), each attending
        # only within itself (compare losses across modes with normalize: valid)
        "batching": "pad",
        "buckets": None,  # bucket lengths (batching: bucket); None = max_length halved 3 times
        "synthetic": None,  # {num_samples, prompt_length}: random prompts + the target's greedy continuations
        # a directory for the target's outputs on the data, computed once (resumably) and read back by every
        # step and every run on the same data (training.features); None = the target runs in every step
        "features": None,
    },
    "train": {
        "steps": 1000,
        "batch_size": 8,  # global, per optimiser step
        "grad_accum": 1,
        "lr": 5e-5,
        "warmup_ratio": 0.015,
        "warmup_steps": None,  # overrides warmup_ratio
        "min_lr_ratio": 0.0,
        "b1": 0.9,
        "b2": 0.95,
        "weight_decay": 0.0,
        "clip_norm": 0.5,
        "ttt_length": 7,
        "decay": 0.8,
        "normalize": "all",  # all: / B*T (EAGLE reference) | valid: / masked count (TorchSpec)
        "compute_dtype": "float32",  # float32 | bfloat16 (master weights stay fp32)
        # true: every drafter TTT step recomputed in the backward pass instead of stored (memory of long
        # sequences; same loss and gradients). The target runs without gradient: nothing to remat there.
        "remat": False,
        # drafter modules kept as they start (e.g. [lm_head, norm] after drafter.warm_start): no gradient, no update
        "freeze": [],
    },
    # -1: all remaining devices. expert > 1: the routed experts of an MoE target are sharded over it
    # (the batch is split over data x fsdp only).
    # held-out samples (JSONL, as data.path) whose per-position TTT accuracy and loss are logged every `every` steps
    # (a multiple of log.every; 0: at the end only); features: their target outputs (needed when data.features is set)
    "eval": {"path": None, "features": None, "every": 0},
    "mesh": {"data": -1, "fsdp": 1, "expert": 1, "model": 1},
    # coordinator: "host:port" (then num_processes, process_id per process) or "auto" (TPU pods, SLURM).
    "distributed": {"coordinator": None, "num_processes": 1, "process_id": None, "cpu_collectives": "gloo"},
    "checkpoint": {"every": 500, "keep": 3},
    "log": {"every": 10, "progress": True},
    "export": {"dir": None, "dtype": None},  # None: <run_dir>/export, params' dtype
}


WARM_STARTS = ("lm_head", "norm", "fc")


class TrainConfigError(ValueError):
    """A training config key or value is wrong; the message names it."""


# ---------------------------------------------------------------------------------------------- config


def merge_config(base: dict, update: dict, where: str = "") -> dict:
    out = copy.deepcopy(base)
    for key, value in (update or {}).items():
        name = f"{where}{key}"
        if key not in base:
            raise TrainConfigError(f"unknown config key '{name}'; known here: {sorted(base)}")
        if isinstance(base[key], dict) and key not in ("random", "synthetic"):
            if not isinstance(value, dict):
                raise TrainConfigError(f"config key '{name}' must be a mapping")
            out[key] = merge_config(base[key], value, name + ".")
        else:
            out[key] = value
    return out


def parse_override(item: str) -> dict:
    """``a.b.c=value`` (value parsed as YAML) -> {"a": {"b": {"c": value}}}."""
    if "=" not in item:
        raise TrainConfigError(f"--set expects key=value, got {item!r}")
    key, raw = item.split("=", 1)
    value = yaml.safe_load(raw)
    for part in reversed(key.strip().split(".")):
        value = {part: value}
    return value


def check_config(cfg: dict) -> None:
    """Values the run would otherwise reject late (after building the target) or not at all."""
    for key, allowed in (("data.batching", BATCHING_MODES), ("train.normalize", NORMALIZATIONS)):
        section, name = key.split(".")
        if cfg[section][name] not in allowed:
            raise TrainConfigError(f"config: {key}={cfg[section][name]!r}; expected one of: {', '.join(allowed)}")
    if not isinstance(cfg["train"]["remat"], bool):
        raise TrainConfigError(f"config: train.remat={cfg['train']['remat']!r}; expected true or false")
    for key, allowed in (("drafter.warm_start", WARM_STARTS), ("train.freeze", None)):
        section, name = key.split(".")
        value = cfg[section][name]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise TrainConfigError(f"config: {key}={value!r}; expected a list of names")
        unknown = [v for v in value if allowed is not None and v not in allowed]
        if unknown:
            raise TrainConfigError(f"config: {key} has {unknown}; expected any of: {', '.join(allowed)}")
    e = cfg["eval"]
    if e["path"] and bool(e["features"]) != bool(cfg["data"]["features"]):
        raise TrainConfigError(
            "config: eval.features and data.features go together (held-out samples are read as the training data is)"
        )
    if int(e["every"] or 0) % max(1, int(cfg["log"]["every"])):
        raise TrainConfigError(f"config: eval.every={e['every']} must be a multiple of log.every={cfg['log']['every']}")
    if cfg["drafter"]["warm_start"] and cfg["drafter"]["init"]:
        raise TrainConfigError(
            "config: drafter.warm_start starts a fresh drafter; drafter.init loads one: set one of them"
        )


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> dict:
    cfg = copy.deepcopy(DEFAULTS)
    if path is not None:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        try:
            cfg = merge_config(cfg, raw)
        except TrainConfigError as e:
            raise TrainConfigError(f"{path}: {e}") from None
    for item in overrides:
        cfg = merge_config(cfg, parse_override(item))
    return cfg


# ------------------------------------------------------------------------------------------ building


def maybe_initialize_distributed(cfg: dict) -> None:
    """``jax.distributed.initialize`` when the config names a coordinator (multi-process / multi-host)."""
    d = cfg["distributed"]
    if not d["coordinator"]:
        return
    if d.get("cpu_collectives"):
        # CPU devices of several processes need a collectives backend; GPU/TPU ignore this option.
        jax.config.update("jax_cpu_collectives_implementation", d["cpu_collectives"])
    if jax.distributed.is_initialized():
        return
    kwargs: dict[str, Any] = {}
    if d["coordinator"] != "auto":  # "auto": TPU pods, SLURM, ... tell JAX themselves
        kwargs.update(coordinator_address=d["coordinator"], num_processes=int(d["num_processes"]))
        if d["process_id"] is not None:
            kwargs["process_id"] = int(d["process_id"])
    jax.distributed.initialize(**kwargs)


def mesh_from_config(m: dict) -> jax.sharding.Mesh:
    """data / fsdp / expert / model sizes; one of them may be -1 = all remaining devices."""
    sizes = {k: int(m[k]) for k in ("data", "fsdp", "expert", "model")}
    n_dev = jax.device_count()
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise TrainConfigError(f"config: mesh may have one axis = -1, got {sizes}")
    if free:
        rest = math.prod(v for v in sizes.values() if v != -1)
        if n_dev % rest:
            raise TrainConfigError(f"config: mesh {sizes}: the fixed axes ({rest}) do not divide {n_dev} devices")
        sizes[free[0]] = n_dev // rest
    if math.prod(sizes.values()) != n_dev:
        raise TrainConfigError(f"config: mesh {sizes} needs {math.prod(sizes.values())} devices, {n_dev} are visible")
    return make_mesh(**sizes)


def build_target(cfg: dict) -> Target:
    t = cfg["target"]
    dtype = DTYPES[t["dtype"]]
    if t["path"]:
        return eagle_jax.load_target(t["path"], dtype)
    if not t["random"]:
        raise TrainConfigError(
            "config: set target.path (an HF checkpoint, a .gguf file or a named model) or target.random (a "
            "TargetConfig dict)"
        )
    target = Target(random_target_config(t["random"]), dtype=dtype, rngs=nnx.Rngs(int(cfg["seed"]) + 1000))
    # A random init has near-uniform next-token distributions; scaling the lm_head makes them as
    # peaked as a trained model's, so that there is something to learn.
    logit_scale = float(t["random"].get("logit_scale", 1.0))
    if target.lm_head is not None and logit_scale != 1.0:
        target.lm_head.kernel.set_value(target.lm_head.kernel[...] * logit_scale)
    return target


def random_target_config(random: dict) -> TargetConfig:
    """``target.random`` -> TargetConfig: its fields (``rope_theta`` short for ``rope: {theta}``), plus
    for ``architecture: deepseek_v3`` the ``mla`` and ``moe`` dicts; num_kv_heads and head_dim follow
    from them there, as in a DeepSeek-V3 config.json. ``logit_scale`` is build_target's."""
    fields = {"architecture": "llama", **{k: v for k, v in random.items() if k != "logit_scale"}}
    subconfigs = {"rope": RopeConfig, "local_rope": RopeConfig, "mla": MLAConfig, "moe": MoEConfig}
    try:
        if "rope_theta" in fields:
            fields["rope"] = {**fields.get("rope", {}), "theta": float(fields.pop("rope_theta"))}
        for key, cls in subconfigs.items():
            if isinstance(fields.get(key), dict):
                fields[key] = cls(**fields[key])
        if isinstance(fields.get("mla"), MLAConfig):
            fields.setdefault("num_kv_heads", fields.get("num_heads"))
            fields.setdefault("head_dim", fields["mla"].qk_head_dim)
        return TargetConfig(**fields)
    except TypeError as e:  # an unknown or missing field
        raise TrainConfigError(f"config: target.random: {e}") from None
    except ConfigError as e:
        raise TrainConfigError(f"config: target.random: {e}") from None


def build_samples(cfg: dict, target: Target, section: str = "data") -> tuple[list[Sample], int, str]:
    """(samples, pad id, one-line summary) from JSONL files or synthetic greedy continuations; ``section``
    "eval": the held-out set's files (``eval.path``), read with the data's tokenizer and length."""
    d = cfg["data"] if section == "data" else {**cfg["data"], "path": cfg["eval"]["path"], "synthetic": None}
    if d["path"]:
        tok_dir = d["tokenizer"] or cfg["target"]["path"]
        if not tok_dir:
            raise TrainConfigError("config: data.path needs data.tokenizer (or target.path holding a tokenizer)")
        tok = load_tokenizer(tok_dir)
        paths = d["path"] if isinstance(d["path"], list) else [d["path"]]
        samples, stats = load_samples(paths, tok, int(d["max_length"]), progress=jax.process_index() == 0)
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        return samples, int(pad), stats.summary()
    if d["synthetic"]:
        s = {"num_samples": 512, "prompt_length": 8, **d["synthetic"]}
        samples = greedy_samples(
            target, int(s["num_samples"]), int(s["prompt_length"]), int(d["max_length"]), seed=int(cfg["seed"])
        )
        return samples, 0, f"{len(samples)} synthetic samples (random prompts + the target's greedy continuations)"
    raise TrainConfigError("config: set data.path (JSONL) or data.synthetic")


def drafter_config_for(cfg: dict, target: Target) -> DrafterConfig:
    """A fresh drafter's config from ``cfg["drafter"]`` and the target's sizes.

    ``drafter.attention`` (null: the target's kind) picks GQA (the EAGLE authors' Llama layout) or MLA
    (the layout of the Kimi-K2 / DeepSeek-V3 drafters of vLLM and SGLang), whose MLA sizes and RoPE
    (YaRN and mscale included; ``rope_theta`` may override theta) are the target's, as in the released
    Kimi-K2.x MLA drafters.
    """
    d, tc = cfg["drafter"], target.config
    kind = d["attention"] or ("mla" if tc.mla is not None else "gqa")
    if kind not in ("gqa", "mla"):
        raise TrainConfigError(f"config: drafter.attention={d['attention']!r}; expected null, 'gqa' or 'mla'")
    if kind == "mla" and tc.mla is None:
        raise TrainConfigError(
            "config: drafter.attention=mla needs an MLA target (DeepSeek-V3 / Kimi-K2); the target is "
            f"{tc.architecture}"
        )
    if kind == "mla" and (d["num_kv_heads"] or d["head_dim"]):
        raise TrainConfigError(
            "config: drafter.num_kv_heads / drafter.head_dim do not apply to an MLA drafter (its sizes are the "
            "target's MLA sizes)"
        )
    aux = tuple(d["aux_layer_ids"]) if d["aux_layer_ids"] else default_aux_layer_ids(tc.num_layers)
    h = d["hidden_size"] or tc.hidden_size
    heads = d["num_heads"] or tc.num_heads
    theta = float(d["rope_theta"] or tc.rope.theta)
    if kind == "mla":
        attention = dict(
            num_kv_heads=heads, head_dim=tc.mla.qk_head_dim, mla=tc.mla, rope=dataclasses.replace(tc.rope, theta=theta)
        )
    else:
        attention = dict(
            num_kv_heads=d["num_kv_heads"] or tc.num_kv_heads,
            head_dim=d["head_dim"] or (tc.head_dim if h == tc.hidden_size else h // heads),
            rope=RopeConfig(theta=theta),
        )
    return DrafterConfig(
        hidden_size=h,
        num_heads=heads,
        **attention,
        intermediate_size=d["intermediate_size"] or tc.intermediate_size,
        vocab_size=tc.vocab_size,
        draft_vocab_size=d["draft_vocab_size"] or tc.vocab_size,
        target_hidden_size=tc.hidden_size,
        num_aux_hidden_states=len(aux),
        rms_norm_eps=d["rms_norm_eps"] or tc.rms_norm_eps,
        max_position_embeddings=tc.max_position_embeddings,
        fc_norm=bool(d["fc_norm"]),
        norm_output=bool(d["norm_output"]),
        aux_layer_ids=aux,
    )


def build_drafter(cfg: dict, target: Target, samples: list[Sample]) -> tuple[Drafter, str]:
    """A drafter (fresh or from ``drafter.init``) with its vocabulary map; returns (drafter, note)."""
    d = cfg["drafter"]
    if d["init"]:
        return load_drafter(d["init"], target, jnp.float32), f"drafter initialised from {d['init']}"
    config = drafter_config_for(cfg, target)
    check_pair(target.config, config, "config: drafter")
    if config.hidden_size != target.config.hidden_size:
        raise TrainConfigError(
            f"config: drafter.hidden_size={config.hidden_size} differs from the target's {target.config.hidden_size}; "
            f"the drafter shares the target's embedding"
        )
    drafter = Drafter(config, target.embed_tokens[...], dtype=jnp.float32, rngs=nnx.Rngs(int(cfg["seed"])))
    v, vd = config.vocab_size, config.draft_vocab_size
    counts = token_counts(samples, v)
    if d["vocab_map"]:
        d2t, t2d = load_vocab_map(d["vocab_map"], v, vd)
        note = f"vocab map from {d['vocab_map']}"
    else:
        # Built from this run's data, never a "first Vd ids" default.
        d2t, t2d = build_vocab_map(counts, vd) if vd < v else (np.zeros(vd, np.int64), np.ones(v, bool))
        note = "identity vocab map" if vd == v else f"vocab map built from the training data ({vd} of {v} ids)"
    drafter.set_vocab_map(d2t)
    if d["warm_start"]:
        warm_start(drafter, target, d["warm_start"])
        note += f"; {', '.join(d['warm_start'])} started from the target"
    return drafter, f"{note}; covers {100 * coverage(counts, t2d):.1f}% of loss tokens"


def warm_start(drafter: Drafter, target: Target, parts: Iterable[str]) -> None:
    """Starts ``parts`` (of WARM_STARTS) of a fresh drafter from the target, so that little data has less to learn:

    - ``lm_head``: the target's output rows of the draft vocabulary (the tied embedding's, for SmolLM2), so the
      drafter's normed output starts in the space of the target's final hidden state;
    - ``norm``: the target's final norm;
    - ``fc``: the last aux state's block the identity and the others zero, so the fused feature starts as the
      highest target layer read (after its 3.1 norm).
    """
    c = drafter.config
    for part in parts:
        if part == "lm_head":
            used = np.arange(c.draft_vocab_size) + np.asarray(drafter.d2t[...])
            drafter.lm_head.kernel.set_value(draft_vocab_head(target, used).T.astype(drafter.lm_head.kernel[...].dtype))
        elif part == "norm":
            # a copy: the step donates the drafter's parameters, never the target's buffers. A (1 + w) norm
            # (Gemma) scales by 1 + its weight; the drafter's scales by its weight.
            weight = target.norm.weight[...] + (1.0 if target.norm.unit_offset else 0.0)
            drafter.norm.weight.set_value(jnp.array(weight, drafter.norm.weight[...].dtype, copy=True))
        elif part == "fc":
            if c.target_hidden_size != c.hidden_size:
                raise TrainConfigError(
                    "config: drafter.warm_start fc needs target_hidden_size == hidden_size, got "
                    f"{c.target_hidden_size} and {c.hidden_size}"
                )
            n, h = c.num_aux_hidden_states, c.hidden_size
            kernel = np.zeros((n * h, h), np.float32)
            kernel[(n - 1) * h :] = np.eye(h, dtype=np.float32)
            drafter.fc.kernel.set_value(jnp.asarray(kernel, drafter.fc.kernel[...].dtype))
        else:
            raise TrainConfigError(
                f"config: drafter.warm_start has {part!r}; expected any of: {', '.join(WARM_STARTS)}"
            )


def trainable_mask(params: Any, freeze: Iterable[str]) -> Any:
    """A pytree of bools over ``params`` (an nnx.State of the drafter's Params): False under a frozen module.

    A name must be a drafter module holding parameters (``lm_head``, ``norm``, ``fc``, ``fc_norm``, ``mlp``, ...)."""
    freeze = set(freeze)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    tops = {str(getattr(path[0], "key", path[0])) for path, _ in leaves}
    unknown = sorted(freeze - tops)
    if unknown:
        raise TrainConfigError(
            f"config: train.freeze has {unknown}; the drafter's modules with parameters are: {', '.join(sorted(tops))}"
        )
    if freeze == tops:
        raise TrainConfigError("config: train.freeze names every module with parameters: nothing would train")
    return jax.tree_util.tree_map_with_path(lambda path, _: str(getattr(path[0], "key", path[0])) not in freeze, params)


def make_optimizer(cfg: dict, trainable: Any = None) -> tuple[optax.GradientTransformation, Callable]:
    """AdamW with warmup + cosine and global-norm clipping; ``trainable`` (``trainable_mask``): the frozen
    parameters' updates are zero and they hold no optimiser state."""
    t = cfg["train"]
    steps = int(t["steps"])
    warmup = int(t["warmup_steps"]) if t["warmup_steps"] is not None else int(round(float(t["warmup_ratio"]) * steps))
    warmup = max(1, warmup)
    lr = float(t["lr"])
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, warmup, max(steps, warmup + 1), lr * float(t["min_lr_ratio"])
    )
    tx = optax.chain(
        optax.clip_by_global_norm(float(t["clip_norm"])),
        optax.adamw(schedule, b1=float(t["b1"]), b2=float(t["b2"]), weight_decay=float(t["weight_decay"])),
    )
    if trainable is not None and not all(jax.tree.leaves(trainable)):
        labels = jax.tree.map(lambda keep: "train" if keep else "frozen", trainable)
        tx = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)
    return tx, schedule
