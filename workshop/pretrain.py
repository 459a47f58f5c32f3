"""Next-token pretraining of a small target on a token stream (how the bundled code model is made).

The corpus is one token stream (documents joined by an end-of-text token); each step samples random
windows of ``seq_len + 1`` tokens. One jitted step of a pure function of (params, optimiser state).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from eagle_jax.checkpoint.hf_target import load_target, save_target
from eagle_jax.config import TargetConfig
from eagle_jax.modeling.target import Target


@dataclass(frozen=True)
class PretrainConfig:
    steps: int = 3000
    batch: int = 8
    seq_len: int = 1024
    lr: float = 1.5e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    save_every: int = 200
    # The last ``long_steps`` steps train on windows of ``long_seq_len`` (same tokens per step, smaller
    # batch): cheap on CPU, where attention cost grows with T, yet the model learns the full context.
    long_steps: int = 0
    long_seq_len: int = 0

    def shape_at(self, step: int) -> tuple[int, int]:
        """(batch, seq_len) of the step with 0-based index ``step``."""
        if self.long_steps and step >= self.steps - self.long_steps:
            return max(1, self.batch * self.seq_len // self.long_seq_len), self.long_seq_len
        return self.batch, self.seq_len


def lm_loss(target: Target, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy over windows tokens [B, T+1]."""
    logits, _ = target(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()


def make_optimizer(cfg: PretrainConfig) -> optax.GradientTransformation:
    warmup = min(cfg.warmup, cfg.steps // 10)
    sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, cfg.steps, cfg.lr * cfg.min_lr_ratio)
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip), optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay)
    )


def sample_windows(stream: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    starts = rng.integers(0, len(stream) - length - 1, batch)
    return np.stack([stream[s : s + length + 1] for s in starts]).astype(np.int32)


def pretrain(
    config: TargetConfig,
    stream: np.ndarray,
    heldout: np.ndarray,
    cfg: PretrainConfig,
    out_dir: str | Path,
    on_save: Callable[[Path], None] | None = None,
    init_from: str | Path | None = None,
) -> Target:
    """Trains from scratch or resumes from ``out_dir/ckpt`` (params, optimiser state, step; the data order is a
    function of the step).

    ``init_from``: an HF target directory whose weights start a fresh run (new optimiser state and
    schedule): continued pretraining of an existing model. Ignored once ``out_dir/ckpt`` exists.

    Every ``save_every`` steps: an HF checkpoint of the params (bf16 for the final export is the
    caller's choice) plus the optimiser state, written atomically, and a JSONL log line.
    """
    if cfg.long_steps and (not 0 < cfg.long_steps <= cfg.steps or cfg.long_seq_len > config.max_position_embeddings):
        raise ValueError(
            f"long phase ({cfg.long_steps} steps at {cfg.long_seq_len} tokens) must fit in {cfg.steps} "
            f"steps and max_position_embeddings {config.max_position_embeddings}"
        )
    out_dir = Path(out_dir)
    ckpt = out_dir / "ckpt"
    log = out_dir / "pretrain_log.jsonl"
    out_dir.mkdir(parents=True, exist_ok=True)
    opt = make_optimizer(cfg)
    if (ckpt / "config.json").exists():
        target = load_target(ckpt, dtype="float32")
        graph, params = nnx.split(target, nnx.Param)
        meta = json.loads((ckpt / "train_state.json").read_text())
        step = meta["step"]
        opt_state = _load_opt_state(ckpt / "opt_state.npz", opt.init(params))
        print(f"resumed at step {step}")
    else:
        if init_from is not None:
            target = load_target(init_from, dtype="float32")
            fresh = nnx.eval_shape(lambda: Target(config, dtype=jnp.float32, rngs=nnx.Rngs(0)))
            want = jax.tree.map(lambda x: x.shape, nnx.state(fresh, nnx.Param))
            got = jax.tree.map(lambda x: x.shape, nnx.state(target, nnx.Param))
            if want != got:
                raise ValueError(f"init_from {init_from}: its parameter shapes differ from the configured target's")
            print(f"starting from the weights of {init_from}")
        else:
            target = Target(config, dtype=jnp.float32, rngs=nnx.Rngs(cfg.seed))
        graph, params = nnx.split(target, nnx.Param)
        step, opt_state = 0, opt.init(params)

    @jax.jit
    def train_step(params, opt_state, tokens):
        def loss_fn(p):
            return lm_loss(nnx.merge(graph, p), tokens)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    @jax.jit
    def eval_loss(params, tokens):
        return lm_loss(nnx.merge(graph, params), tokens)

    eval_rng = np.random.default_rng(12345)
    eval_batch = jnp.asarray(sample_windows(heldout, 8, cfg.seq_len, eval_rng))
    if cfg.long_steps:
        eval_long = jnp.asarray(sample_windows(heldout, 2, cfg.long_seq_len, eval_rng))
    t0, tokens_done = time.perf_counter(), 0
    while step < cfg.steps:
        b, t = cfg.shape_at(step)
        # Windows drawn from a generator keyed by the step: a resumed run sees the same data.
        batch = jnp.asarray(sample_windows(stream, b, t, np.random.default_rng([cfg.seed, step])))
        params, opt_state, loss, gnorm = train_step(params, opt_state, batch)
        step += 1
        tokens_done += b * t
        if step % 20 == 0 or step == cfg.steps:
            rate = tokens_done / (time.perf_counter() - t0)
            print(
                f"step {step}/{cfg.steps} loss {float(loss):.3f} gnorm {float(gnorm):.2f} {rate:.0f} tok/s", flush=True
            )
        if step % cfg.save_every == 0 or step == cfg.steps:
            ev = float(eval_loss(params, eval_batch))
            record = {"step": step, "seq_len": t, "loss": float(loss), "heldout_loss": ev, "heldout_ppl": math.exp(ev)}
            if cfg.long_steps and step > cfg.steps - cfg.long_steps:
                record[f"heldout_loss_{cfg.long_seq_len}"] = float(eval_loss(params, eval_long))
            target = nnx.merge(graph, params)
            _save(target, opt_state, step, ckpt)
            with open(log, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"step {step}: heldout loss {ev:.3f} (ppl {math.exp(ev):.1f}); saved", flush=True)
            if on_save:
                on_save(ckpt)
    return nnx.merge(graph, params)


def _save(target: Target, opt_state, step: int, ckpt: Path) -> None:
    tmp = ckpt.with_name(ckpt.name + ".new")
    if tmp.exists():  # left over from a run killed mid-save; the previous checkpoint is intact
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_target(target, tmp)
    leaves = jax.tree_util.tree_leaves(opt_state)
    np.savez(tmp / "opt_state.npz", *[np.asarray(x) for x in leaves])
    (tmp / "train_state.json").write_text(json.dumps({"step": step}))
    # Swap in the new checkpoint; a kill between the renames leaves ckpt.old, which the next save clears.
    old = ckpt.with_name(ckpt.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if ckpt.exists():
        ckpt.rename(old)
    tmp.rename(ckpt)
    if old.exists():
        shutil.rmtree(old)


def _load_opt_state(file: Path, template):
    data = np.load(file)
    leaves = [jnp.asarray(data[f"arr_{i}"]) for i in range(len(data.files))]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), leaves)
