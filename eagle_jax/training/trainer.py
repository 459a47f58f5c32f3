"""TTT training of an EAGLE-3 / 3.1 drafter against a frozen target.

One jitted step, compiled once: (drafter params, optimiser state, frozen drafter variables, target
state, batch) -> (params, optimiser state, metrics). The target's aux states and logits are computed
inside it under ``stop_gradient``; only the drafter's ``nnx.Param`` variables are trained (the
embedding and d2t/t2d are ``Frozen``). Master weights stay fp32; ``compute_dtype`` bfloat16 casts
a copy for the forward/backward. Gradient accumulation is a ``lax.scan`` over micro-batches inside the
step, so one step = one optimiser update whatever the accumulation (with ``normalize: valid`` each
micro-batch is normalised by its own count before averaging). Batches are sharded over
(data, fsdp), parameters and optimiser state by the rules of ``eagle_jax.sharding``. Batches carry
positions and segment ids (``data.batching: pack`` puts several documents in a row): the target and
the drafter attend within a document only. Each log record lists every step's padded length and
tokens/s; the run's summary has tokens/s per padded length (compiling steps left out).

Checkpoints (orbax, every ``checkpoint.every`` steps, last ``checkpoint.keep`` kept) hold the params,
the optimiser state, the step, the data position (epoch, next batch) and the seed, plus the drafter
config and d2t needed to export without the training run. There is no other randomness: the data
order is a function of (seed, epoch) and the model has no dropout. A resumed run therefore continues
the same loss curve.

The config and what it builds (target, data, drafter, optimiser) are ``eagle_jax.training.recipe``'s;
its names are importable from here too.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from eagle_jax.checkpoint.eagle_drafter import save_drafter
from eagle_jax.checkpoint.hf_target import DTYPES
from eagle_jax.config import DrafterConfig, aux_layer_ids_for
from eagle_jax.modeling.drafter import Drafter
from eagle_jax.modeling.flops import attention_flops, matmul_params
from eagle_jax.modeling.target import Target
from eagle_jax.sharding import BATCH_AXES, logical_to_spec, put, tree_shardings
from eagle_jax.training.data import Batcher, DataPosition
from eagle_jax.training.features import compute_features, draft_vocab_head
from eagle_jax.training.heldout import HeldOut, make_eval_step, target_outputs
from eagle_jax.training.recipe import (
    DEFAULTS,
    TrainConfigError,
    build_drafter,
    build_samples,
    build_target,
    check_config,
    drafter_config_for,
    load_config,
    make_optimizer,
    maybe_initialize_distributed,
    merge_config,
    mesh_from_config,
    parse_override,
    random_target_config,
    trainable_mask,
)
from eagle_jax.training.ttt import simulated_acceptance_length, ttt_loss

# ------------------------------------------------------------------------------------- throughput


def train_flops_per_token(
    target: Target, drafter: Drafter, seq_len: int, ttt_length: int, with_target: bool = True
) -> float:
    """Model FLOPs per token of one train step (matmuls only; norms, softmax, RoPE ignored).

    Target: forward only, 2 x the weights a token uses (MoE: its activated experts) (+ lm_head, or the
    tied embedding as lm_head) plus causal attention over T/2 keys per layer. Drafter: fc once, and per
    TTT step the layer and lm_head, each forward + backward = 6 x weights, plus attention over
    T/2 + steps keys (forward + backward = 3 x). MLA attention is counted in the expanded per-head form
    both compute here. ``with_target`` False (training from precomputed features): the drafter's part,
    plus the target's logits over the draft vocabulary from its stored hidden states.
    """
    tc = target.config
    if not with_target:
        return drafter_flops_per_token(drafter, seq_len, ttt_length)
    t_params = matmul_params(target) + (tc.vocab_size * tc.hidden_size if tc.tie_word_embeddings else 0)
    t_attn = attention_flops(tc, seq_len / 2) * tc.num_layers
    return 2 * t_params + t_attn + drafter_flops_per_token(drafter, seq_len, ttt_length) - _features_head_flops(drafter)


def _features_head_flops(drafter: Drafter) -> float:
    """The target's logits over the draft vocabulary from its stored hidden states (training from features)."""
    return 2 * drafter.config.draft_vocab_size * drafter.config.target_hidden_size


def drafter_flops_per_token(drafter: Drafter, seq_len: int, ttt_length: int) -> float:
    """A train step's FLOPs per token from precomputed target features: fc once, per TTT step the layer and
    lm_head forward + backward (6 x weights) and attention over T/2 + steps keys (3 x forward), plus the
    target's draft-vocabulary logits from its stored hidden states."""
    dc = drafter.config
    fc = dc.fc_in_features * dc.hidden_size
    layer = matmul_params(drafter) - fc
    d_attn = attention_flops(dc, seq_len / 2 + ttt_length / 2)
    return _features_head_flops(drafter) + 6 * fc + ttt_length * (6 * layer + 3 * d_attn)


def measure_matmul_peak(dtype=jnp.float32) -> float:
    """Achievable FLOP/s of one device: best of a few timed square matmuls (once, at start)."""
    n = 1024 if jax.default_backend() == "cpu" else 8192
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


# ------------------------------------------------------------------------------------------ the step


def _with_segments(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """input_ids / loss_mask [..., T] with positions and segment ids; absent: one sequence per row."""
    ids = batch["input_ids"]
    if "positions" in batch:
        return batch
    positions = jnp.broadcast_to(jnp.arange(ids.shape[-1], dtype=jnp.int32), ids.shape)
    return {**batch, "positions": positions, "segment_ids": jnp.ones(ids.shape, jnp.int32)}


def make_train_step(
    graphdef_d: nnx.GraphDef,
    graphdef_t: nnx.GraphDef,
    tx: optax.GradientTransformation,
    *,
    aux_layer_ids: tuple[int, ...],
    ttt_length: int,
    decay: float,
    normalize: str,
    compute_dtype,
    remat: bool = False,
    from_features: bool = False,
    trainable: Any = None,
) -> Callable:
    """The pure train step: (params, opt_state, frozen, target_state, batch) -> (params, opt_state, metrics).

    ``from_features``: the target's outputs come precomputed in the batch (``aux``, ``target_hidden``,
    ``target_argmax``, from ``training.features``) and ``target_state`` is only the target's output
    rows for the draft vocabulary (``features.draft_vocab_head``); the target itself never runs.

    batch: input_ids / loss_mask / positions / segment_ids [grad_accum, micro_batch, T] (``data.collate``;
    without positions and segment_ids: one sequence per row at positions 0..T-1). The target and the
    drafter attend within each segment (packed documents). ``aux_layer_ids``: the target layers the
    drafter reads. ``remat``: the drafter's TTT steps recomputed in the backward pass (ttt_loss).
    ``trainable`` (``recipe.trainable_mask``): frozen parameters get a zero gradient, so it is never computed.
    """

    def cast(tree):
        return jax.tree.map(lambda x: x.astype(compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def loss_fn(params, frozen, aux, t_logits, t_argmax, mb):
        drafter = nnx.merge(graphdef_d, cast(params), frozen)
        out = ttt_loss(
            drafter,
            aux,
            mb["input_ids"],
            t_logits,
            mb["loss_mask"],
            ttt_length=ttt_length,
            decay=decay,
            normalize=normalize,
            positions=mb["positions"],
            segment_ids=mb["segment_ids"],
            remat=remat,
            target_argmax=t_argmax,
        )
        return out.total, out

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def micro(params, frozen, target_state, mb):
        t_logits, aux, t_argmax = target_outputs(mb, target_state, graphdef_t, aux_layer_ids, from_features)
        (_, out), grads = grad_fn(params, frozen, aux.astype(compute_dtype), t_logits, t_argmax, mb)
        return grads, out

    def step(params, opt_state, frozen, target_state, batch):
        batch = _with_segments(batch)
        accum = batch["input_ids"].shape[0]
        if accum == 1:
            grads, out = micro(params, frozen, target_state, jax.tree.map(lambda x: x[0], batch))
            outs = jax.tree.map(lambda x: x[None], out)
        else:

            def body(acc, mb):
                g, out = micro(params, frozen, target_state, mb)
                return jax.tree.map(jnp.add, acc, g), out

            zeros = jax.tree.map(jnp.zeros_like, params)
            grads, outs = jax.lax.scan(body, zeros, batch)
            grads = jax.tree.map(lambda g: g / accum, grads)
        if trainable is not None:
            grads = jax.tree.map(lambda g, keep: g if keep else jnp.zeros_like(g), grads, trainable)
        updates, opt_state = tx.update(grads, opt_state, params)
        metrics = {
            "loss": jnp.mean(outs.total),
            "losses": jnp.mean(outs.losses, axis=0),
            "accuracies": jnp.mean(outs.accuracies, axis=0),
            "grad_norm": optax.tree.norm(grads),
        }
        return optax.apply_updates(params, updates), opt_state, metrics

    return step


# ----------------------------------------------------------------------------------- checkpointing


def _host(x: jax.Array) -> np.ndarray:
    """A replicated or fully addressable array as numpy on this process."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    return np.asarray(x.addressable_data(0))


def _gather(tree: Any) -> Any:
    """Full values of (possibly multi-process sharded) arrays on every process (a collective)."""
    from jax.experimental import multihost_utils

    def one(x):
        if getattr(x, "is_fully_addressable", True):
            return np.asarray(jax.device_get(x))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def _checkpoint_manager(run_dir: Path, cfg: dict | None = None, read_only: bool = False):
    import orbax.checkpoint as ocp

    c = (cfg or DEFAULTS)["checkpoint"]
    options = ocp.CheckpointManagerOptions(
        max_to_keep=int(c["keep"]) if c["keep"] else None, create=not read_only, read_only=read_only
    )
    return ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=options)


def export_drafter(graphdef_d: nnx.GraphDef, params: Any, frozen: Any, out_dir: str | Path, dtype=None) -> None:
    """Writes the drafter in the EAGLE PyTorch layout (``save_drafter``); call on every process."""
    host_params = _gather(params)
    if jax.process_index() == 0:
        drafter = nnx.merge(graphdef_d, host_params, frozen)
        save_drafter(drafter, out_dir, dtype)


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype=None) -> int:
    """Exports a training checkpoint (a run's ``checkpoints`` directory = its latest step, or one step's
    directory) to the EAGLE layout without the target or the data. Returns the exported step."""
    import orbax.checkpoint as ocp

    checkpoint = Path(checkpoint).absolute()
    if checkpoint.name.isdigit() and (checkpoint / "meta").exists():
        root, step = checkpoint.parent, int(checkpoint.name)
    else:
        root = checkpoint / "checkpoints" if (checkpoint / "checkpoints").is_dir() else checkpoint
        step = None
    mngr = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True, create=False))
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"{root}: no training checkpoint found")
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    config = DrafterConfig.from_hf(meta["drafter_config"], f"{root}/{step}/meta")
    abstract = nnx.eval_shape(lambda: Drafter(config))
    graphdef, params, frozen = nnx.split(abstract, nnx.Param, ...)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), params)
    restored = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(params)))
    drafter = nnx.merge(graphdef, restored.params, frozen)
    drafter.set_vocab_map(np.asarray(meta["d2t"], np.int64))
    save_drafter(drafter, out_dir, dtype)  # the (abstract) embedding is not written
    return step


# ------------------------------------------------------------------------------------------ the loop


@dataclasses.dataclass
class _Step:
    """A dispatched train step: its device metrics, padded length, tokens (padding included) and loss
    tokens; ``seconds`` once done, None when it compiled (kept out of the throughput)."""

    metrics: dict
    length: int
    tokens: int
    loss_tokens: int
    seconds: float | None = None


class _StepTimer:
    """Device time per step, keeping one step in flight: after dispatching step k it waits for step
    k-1, so the device never idles on the host, and the gap between two completions is a step's time.
    A step of a new batch shape compiles inside the call: the step before it is waited for first, and
    it is not timed. Tokens and seconds add up per padded length (``tokens_per_s_by_length``)."""

    def __init__(self) -> None:
        self.inflight: list[_Step] = []
        self.done: list[_Step] = []
        self.last = time.perf_counter()  # completion of the last finished step
        self.compile_s: float | None = None  # of the first step
        self.by_length: dict[int, list[float]] = {}  # length -> [tokens, seconds]

    def run(self, fn: Callable[[], tuple], length: int, tokens: int, loss_tokens: int) -> tuple:
        """``fn()`` (the jitted step, returning (..., metrics)) for a batch of ``length``."""
        compiles = length not in self.by_length
        if compiles:
            self.flush()
            self.by_length[length] = [0, 0.0]
        t0 = time.perf_counter()
        out = fn()
        step = _Step(out[-1], length, tokens, loss_tokens)
        if compiles:
            jax.block_until_ready(step.metrics)
            self.last = time.perf_counter()
            self.compile_s = self.last - t0 if self.compile_s is None else self.compile_s
            self.done.append(step)
        else:
            self.inflight.append(step)
            while len(self.inflight) > 1:
                self._finish(self.inflight.pop(0))
        return out

    def _finish(self, step: _Step) -> None:
        jax.block_until_ready(step.metrics)
        now = time.perf_counter()
        step.seconds, self.last = now - self.last, now
        self.by_length[step.length][0] += step.tokens
        self.by_length[step.length][1] += step.seconds
        self.done.append(step)

    def flush(self) -> None:
        while self.inflight:
            self._finish(self.inflight.pop(0))

    def take(self) -> list[_Step]:
        """Every step run since the last call, all finished."""
        self.flush()
        out, self.done = self.done, []
        return out

    def untimed(self) -> None:
        """Host work that is not training (a checkpoint save) ends here: the next step is timed from now."""
        self.last = time.perf_counter()

    def tokens_per_s_by_length(self) -> dict[int, float]:
        return {length: tok / sec for length, (tok, sec) in sorted(self.by_length.items()) if sec > 0}


def _record(
    steps: list[_Step], step: int, pos: DataPosition, lr: float, flop_fraction: float, compile_s: float | None
) -> dict[str, Any]:
    """One log record from the steps since the last one: means of their metrics, throughput, and each
    step's padded length and tokens/s (None: it compiled)."""
    host = [jax.tree.map(_host, s.metrics) for s in steps]
    timed = [s for s in steps if s.seconds is not None]
    seconds = sum(s.seconds for s in timed)
    tok_s = sum(s.tokens for s in timed) / seconds if seconds > 0 else None  # None: only compiling steps
    accs = np.mean([h["accuracies"] for h in host], axis=0)
    return {
        "step": step,
        "loss": float(np.mean([h["loss"] for h in host])),
        "loss_per_position": np.mean([h["losses"] for h in host], axis=0).round(6).tolist(),
        "acc_per_position": accs.round(6).tolist(),
        "simulated_al": float(simulated_acceptance_length(accs)),
        "grad_norm": float(host[-1]["grad_norm"]),
        "lr": lr,
        "tokens_per_s": tok_s,
        "loss_tokens": sum(s.loss_tokens for s in steps),
        "mfu": None if tok_s is None else tok_s * flop_fraction,  # fraction of the measured matmul peak
        "lengths": [s.length for s in steps],
        "step_tokens_per_s": [None if s.seconds is None else s.tokens / s.seconds for s in steps],
        "epoch": pos.epoch,
        "next_batch": pos.index,
        "compile_s": compile_s,
    }


def train(cfg: dict, *, stop_after: int | None = None) -> dict[str, Any]:
    """Runs (or resumes) the training run described by ``cfg``; returns a summary with the logged records.

    ``stop_after``: stop once this step is done (after its checkpoint), as if the job were killed; the
    next call with the same config resumes from the latest checkpoint.
    """
    check_config(cfg)
    maybe_initialize_distributed(cfg)
    t_cfg = cfg["train"]
    run_dir = Path(cfg["run_dir"])
    is_main = jax.process_index() == 0
    log = (lambda *a: print(*a, flush=True)) if is_main else (lambda *a: None)

    mesh = mesh_from_config(cfg["mesh"])
    accum = int(t_cfg["grad_accum"])
    batch_size = int(t_cfg["batch_size"])
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if batch_size % accum or (batch_size // accum) % shards:
        raise TrainConfigError(
            f"config: train.batch_size={batch_size} / grad_accum={accum} must be a multiple of "
            f"mesh data x fsdp = {shards}"
        )
    compute_dtype = DTYPES[t_cfg["compute_dtype"]]

    target = build_target(cfg)
    samples, pad_id, data_note = build_samples(cfg, target)
    drafter, vocab_note = build_drafter(cfg, target, samples)
    log(f"data: {data_note}\n{vocab_note}")
    batcher = Batcher(
        samples,
        batch_size,
        int(cfg["data"]["max_length"]),
        mode=cfg["data"]["batching"],
        buckets=tuple(cfg["data"]["buckets"]) if cfg["data"]["buckets"] else None,
        seed=int(cfg["seed"]),
        pad_id=pad_id,
    )

    graphdef_d, params, frozen = nnx.split(drafter, nnx.Param, ...)
    trainable = trainable_mask(params, t_cfg["freeze"]) if t_cfg["freeze"] else None
    tx, schedule = make_optimizer(cfg, trainable)
    graphdef_t, target_state = nnx.split(target)
    aux_layer_ids = aux_layer_ids_for(drafter.config, target.config)
    param_sh = tree_shardings(params, mesh)
    params = jax.tree.map(put, params, param_sh)
    frozen = jax.tree.map(put, frozen, tree_shardings(frozen, mesh))
    replicated = NamedSharding(mesh, PartitionSpec())
    features = None
    if cfg["data"]["features"]:  # the target's outputs computed once (or read back): the target never runs in a step
        features = compute_features(
            target,
            samples,
            aux_layer_ids,
            cfg["data"]["features"],
            length=int(cfg["data"]["max_length"]),
            progress=is_main and cfg["log"]["progress"],
        )
        used = np.arange(drafter.config.draft_vocab_size) + np.asarray(drafter.d2t[...])
        target_state = put(draft_vocab_head(target, used), replicated)
        log(f"target features from {features.directory} ({int(features.offsets[-1])} tokens)")
    else:
        target_state = jax.tree.map(put, target_state, tree_shardings(target_state, mesh))
    opt_sh = tree_shardings(jax.eval_shape(tx.init, params), mesh)
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
    batch_sh = NamedSharding(mesh, PartitionSpec(None, *logical_to_spec(BATCH_AXES, (batch_size // accum, 1), mesh)))

    step_fn = make_train_step(
        graphdef_d,
        graphdef_t,
        tx,
        aux_layer_ids=aux_layer_ids,
        ttt_length=int(t_cfg["ttt_length"]),
        decay=float(t_cfg["decay"]),
        normalize=t_cfg["normalize"],
        compute_dtype=compute_dtype,
        remat=t_cfg["remat"],
        from_features=features is not None,
        trainable=trainable,
    )
    jitted = jax.jit(step_fn, donate_argnums=(0, 1), out_shardings=(param_sh, opt_sh, replicated))
    heldout = None
    if cfg["eval"]["path"]:
        e_samples, _, e_note = build_samples(cfg, target, "eval")
        e_features = None
        if features is not None:
            e_features = compute_features(
                target,
                e_samples,
                aux_layer_ids,
                cfg["eval"]["features"],
                length=int(cfg["data"]["max_length"]),
                progress=is_main and cfg["log"]["progress"],
            )
        e_batcher = Batcher(
            e_samples,
            1,
            int(cfg["data"]["max_length"]),
            mode=cfg["data"]["batching"],
            buckets=tuple(cfg["data"]["buckets"]) if cfg["data"]["buckets"] else None,
            seed=int(cfg["seed"]),
            pad_id=pad_id,
        )
        e_step = make_eval_step(
            graphdef_d,
            graphdef_t,
            aux_layer_ids=aux_layer_ids,
            ttt_length=int(t_cfg["ttt_length"]),
            decay=float(t_cfg["decay"]),
            compute_dtype=compute_dtype,
            from_features=features is not None,
        )
        heldout = HeldOut(e_batcher, e_features, e_step, lambda host: {k: put(v, replicated) for k, v in host.items()})
        log(f"held-out: {e_note}")
    eval_every = int(cfg["eval"]["every"] or 0)

    # Resume.
    import orbax.checkpoint as ocp

    every = int(cfg["checkpoint"]["every"] or 0)
    mngr = _checkpoint_manager(run_dir, cfg) if every else None
    step, pos = 0, DataPosition()
    if mngr is not None and mngr.latest_step() is not None:
        last = mngr.latest_step()
        abstract = lambda tree, sh: jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh
        )
        r = mngr.restore(
            last,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract(params, param_sh)),
                opt_state=ocp.args.StandardRestore(abstract(opt_state, opt_sh)),
                meta=ocp.args.JsonRestore(),
            ),
        )
        params, opt_state = r.params, r.opt_state
        step, pos = int(r.meta["step"]), DataPosition.from_dict(r.meta["data"])
        if int(r.meta["seed"]) != int(cfg["seed"]):
            raise TrainConfigError(
                f"{run_dir}: checkpoint was trained with seed {r.meta['seed']}, config has {cfg['seed']}"
            )
        log(f"resumed from step {step} (epoch {pos.epoch}, batch {pos.index})")
        if is_main and (run_dir / "log.jsonl").exists():
            # Steps logged after the checkpoint are redone: drop their records so the log stays one curve.
            lines = (run_dir / "log.jsonl").read_text().splitlines()
            kept = [line for line in lines if json.loads(line)["step"] <= step]
            (run_dir / "log.jsonl").write_text("".join(line + "\n" for line in kept))

    total_steps = int(t_cfg["steps"])
    seq_len = int(cfg["data"]["max_length"])
    flops_tok = train_flops_per_token(target, drafter, seq_len, int(t_cfg["ttt_length"]), with_target=features is None)
    peak = measure_matmul_peak(compute_dtype) * jax.device_count()
    keeps = jax.tree.leaves(trainable) if trainable is not None else [True] * len(jax.tree.leaves(params))
    n_params = sum(int(np.prod(x.shape)) for x, keep in zip(jax.tree.leaves(params), keeps) if keep)
    log(
        f"mesh {dict(mesh.shape)}; drafter {n_params / 1e6:.2f}M trainable params; "
        f"~{flops_tok / 1e6:.1f} MFLOP/token; measured matmul peak {peak / 1e9:.1f} GFLOP/s"
    )

    meta_base = {
        "seed": int(cfg["seed"]),
        "drafter_config": drafter.config.to_hf(),
        "d2t": np.asarray(drafter.d2t[...]).tolist(),
    }
    log_path = run_dir / "log.jsonl"
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    log_every = max(1, int(cfg["log"]["every"]))
    records: list[dict] = []
    timer = _StepTimer()
    bar = tqdm(
        total=total_steps, initial=step, desc="ttt", unit="step", disable=not (is_main and cfg["log"]["progress"])
    )
    if heldout is not None and step == 0:  # the curve starts at the drafter training starts from (warm start or init)
        rec = {"step": 0, "loss_tokens": 0, **heldout.evaluate(params, frozen, target_state)}
        log(
            f"step 0: held-out accuracy per position {rec['heldout_acc_per_position']}, "
            f"simulated AL {rec['heldout_simulated_al']:.3f}"
        )
        records.append(rec)
        if is_main:
            with log_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
    while step < total_steps:
        host_batch = batcher.batch(pos)
        length = host_batch["input_ids"].shape[1]
        if features is not None:
            host_batch.update(features.collate(batcher.plan(pos.epoch)[pos.index][1], length))
        batch = {k: put(v.reshape(accum, batch_size // accum, *v.shape[1:]), batch_sh) for k, v in host_batch.items()}
        params, opt_state, _ = timer.run(
            lambda: jitted(params, opt_state, frozen, target_state, batch),
            length,
            host_batch["input_ids"].size,
            int(host_batch["loss_mask"].sum()),
        )
        step += 1
        pos = batcher.next_position(pos)
        bar.update(1)
        if step % log_every == 0 or step == total_steps or step == stop_after:
            rec = _record(timer.take(), step, pos, float(schedule(step - 1)), flops_tok / peak, timer.compile_s)
            if heldout is not None and ((eval_every and step % eval_every == 0) or step == total_steps):
                rec.update(heldout.evaluate(params, frozen, target_state))
                timer.untimed()
                log(
                    f"step {step}: held-out accuracy per position {rec['heldout_acc_per_position']}, "
                    f"simulated AL {rec['heldout_simulated_al']:.3f}"
                )
            records.append(rec)
            bar.set_postfix(
                loss=f"{rec['loss']:.4f}",
                acc0=f"{rec['acc_per_position'][0]:.3f}",
                al=f"{rec['simulated_al']:.2f}",
                tok_s=f"{rec['tokens_per_s'] or 0:.0f}",
            )
            if is_main:
                with log_path.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
        if mngr is not None and (step % every == 0 or step == total_steps or step == stop_after):
            timer.flush()
            meta = {**meta_base, "step": step, "data": pos.to_dict()}
            mngr.save(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardSave(params),
                    opt_state=ocp.args.StandardSave(opt_state),
                    meta=ocp.args.JsonSave(meta),
                ),
                force=True,
            )
            timer.untimed()
        if stop_after is not None and step >= stop_after:
            break
    bar.close()
    if mngr is not None:
        mngr.wait_until_finished()
        mngr.close()
    by_length = timer.tokens_per_s_by_length()
    log("tokens/s by padded length: " + (", ".join(f"{n}: {v:.0f}" for n, v in by_length.items()) or "none timed"))
    summary = {
        "step": step,
        "records": records,
        "run_dir": str(run_dir),
        "compile_s": timer.compile_s,
        "tokens_per_s_by_length": by_length,
    }
    if step >= total_steps:
        out = Path(cfg["export"]["dir"] or run_dir / "export")
        export_drafter(graphdef_d, params, _gather(frozen), out, cfg["export"]["dtype"])
        log(f"exported drafter (EAGLE layout) to {out}")
        summary["export_dir"] = str(out)
    return summary


__all__ = [
    "DEFAULTS",
    "TrainConfigError",
    "build_drafter",
    "build_samples",
    "build_target",
    "check_config",
    "drafter_config_for",
    "export_checkpoint",
    "export_drafter",
    "load_config",
    "make_optimizer",
    "make_train_step",
    "maybe_initialize_distributed",
    "measure_matmul_peak",
    "merge_config",
    "mesh_from_config",
    "parse_override",
    "random_target_config",
    "train",
    "train_flops_per_token",
    "drafter_flops_per_token",
]
