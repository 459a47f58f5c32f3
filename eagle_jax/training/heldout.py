"""Held-out TTT accuracy during training: the drafter's per-position accuracy and loss on conversations it never
trains on.

Training accuracy rises on data a drafter has seen (a from-scratch head memorises little data), so checkpoints and
recipes are compared on held-out samples instead: ``eval.path`` (JSONL, the kinds ``data.path`` reads), packed as
the training data is, their target outputs computed once into ``eval.features`` (``training.features``). Every
``eval.every`` steps and at the end, the whole set runs through the same TTT loss without gradients; accuracies and
losses are means over every supervised position of the set (each batch weighted by its count), so the figure does
not depend on how the set is cut into batches.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.training.data import Batcher, DataPosition
from eagle_jax.training.features import FeatureStore, draft_vocab_logits
from eagle_jax.training.ttt import simulated_acceptance_length, ttt_loss


def target_outputs(
    mb: dict, target_state: Any, graphdef_t: nnx.GraphDef | None, aux_layer_ids: tuple[int, ...], from_features: bool
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(target logits, aux states, target argmax or None) for a micro-batch, without gradient: from the batch's
    precomputed features (``target_state`` = the draft-vocabulary head rows) or from the frozen target itself."""
    if from_features:
        t_logits, aux, t_argmax = draft_vocab_logits(mb["target_hidden"], target_state), mb["aux"], mb["target_argmax"]
    else:
        target = nnx.merge(graphdef_t, target_state)
        (t_logits, aux), t_argmax = target(mb["input_ids"], aux_layer_ids, mb["positions"], mb["segment_ids"]), None
    return jax.lax.stop_gradient(t_logits), jax.lax.stop_gradient(aux), t_argmax


def make_eval_step(
    graphdef_d: nnx.GraphDef,
    graphdef_t: nnx.GraphDef | None,
    *,
    aux_layer_ids: tuple[int, ...],
    ttt_length: int,
    decay: float,
    compute_dtype,
    from_features: bool,
) -> Callable:
    """(params, frozen, target_state, batch [rows, T]) -> per-position (loss x count, correct, count) sums."""

    def step(params, frozen, target_state, batch):
        params = jax.tree.map(lambda x: x.astype(compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
        drafter = nnx.merge(graphdef_d, params, frozen)
        t_logits, aux, t_argmax = target_outputs(batch, target_state, graphdef_t, aux_layer_ids, from_features)
        # per supervised position ("valid") whatever the training normalisation: the sums are then exact
        out = ttt_loss(
            drafter,
            aux.astype(compute_dtype),
            batch["input_ids"],
            t_logits,
            batch["loss_mask"],
            ttt_length=ttt_length,
            decay=decay,
            normalize="valid",
            positions=batch["positions"],
            segment_ids=batch["segment_ids"],
            target_argmax=t_argmax,
        )
        return out.losses * out.counts, out.accuracies * out.counts, out.counts

    return jax.jit(step)


class HeldOut:
    """The held-out set, batched like the training data; ``evaluate`` -> a record of its accuracies and losses."""

    def __init__(self, batcher: Batcher, features: FeatureStore | None, eval_step: Callable, put_batch: Callable):
        self.batcher, self.features, self.eval_step, self.put_batch = batcher, features, eval_step, put_batch

    def evaluate(self, params: Any, frozen: Any, target_state: Any) -> dict[str, Any]:
        sums = None
        for index in range(self.batcher.num_batches(0)):
            pos = DataPosition(0, index)
            host = self.batcher.batch(pos)
            if self.features is not None:
                host.update(self.features.collate(self.batcher.plan(0)[index][1], host["input_ids"].shape[1]))
            out = self.eval_step(params, frozen, target_state, self.put_batch(host))
            out = [np.asarray(jax.device_get(x), np.float64) for x in out]
            sums = out if sums is None else [a + b for a, b in zip(sums, out)]
        loss_sum, correct, counts = sums
        acc = correct / np.maximum(counts, 1.0)
        return {
            "heldout_loss_per_position": (loss_sum / np.maximum(counts, 1.0)).round(6).tolist(),
            "heldout_acc_per_position": acc.round(6).tolist(),
            "heldout_simulated_al": float(simulated_acceptance_length(acc)),
            "heldout_positions": int(counts[0]),
        }


__all__ = ["HeldOut", "make_eval_step", "target_outputs"]
