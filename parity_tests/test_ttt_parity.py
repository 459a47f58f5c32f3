"""TTT: eagle_jax.training.ttt against the independent PyTorch reference, on the same weights.

Compared: the total loss, each step's loss and accuracy, and the gradient of every trainable drafter
parameter, for EAGLE-3 and EAGLE-3.1 flags, Vd < V, both normalisations and both accuracy
denominators, and an MLA (DeepSeek-V3 / Kimi-K2) drafter. Then structural tests of the unroll: the
attention pattern of each step, the causal dependency of each (step, index) on tokens and features,
and equality with the drafter's own cached inference path (Drafter.step with a KV cache; for MLA the
latent cache and absorbed attention against the unroll's expanded heads), which pins RoPE positions
and feature feeding per step.

Tolerances (fp32 on CPU): the two sides do the same math with different op grouping (grouped-query
einsums vs repeated heads, gathered vs boolean-indexed vocab), so values agree to a few ulp of their
accumulations. Losses: rtol 1e-5 on O(1) values. Gradients: |g - g_ref| <= 1e-5 * max|g_ref| + 1e-7
per tensor; an index, shift or mask error moves these by O(10%) or more.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from eagle_jax import Drafter, DrafterConfig
from eagle_jax.checkpoint.eagle_drafter import drafter_key
from eagle_jax.modeling.layers import attend, heads_first
from eagle_jax.training import ttt
from parity_tests.torch_reference import RefDrafter, RefDrafterConfig
from parity_tests.torch_reference import ttt_loss as ref_ttt_loss
from parity_tests.torch_reference import ttt_unroll as ref_ttt_unroll

jax.config.update("jax_default_matmul_precision", "highest")

LOSS_RTOL = 1e-5
GRAD_REL = 1e-5
GRAD_ABS = 1e-7


def cfg_dict(**kw) -> dict:
    d = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # != H / heads on purpose
        intermediate_size=48,
        rms_norm_eps=1e-5,
        vocab_size=96,
        draft_vocab_size=64,  # Vd < V
        target_hidden_size=24,  # != H: fc input is 3 * 24
        num_hidden_layers=1,
    )
    d.update(kw)
    return d


# An MLA drafter (DeepSeek-V3 / Kimi-K2 layout): q LoRA, value heads narrower than query heads, Kimi's
# YaRN over 4 rope dims (its softmax scale and cos/sin scale differ from plain RoPE's).
MLA = dict(
    architectures=["Eagle3DeepseekV3ForCausalLM"],
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=12,
    rope_theta=50000.0,
    rope_scaling=dict(
        type="yarn",
        factor=16.0,
        original_max_position_embeddings=4,
        beta_fast=1.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
)
VARIANTS = {
    "eagle3": dict(),
    "eagle3.1": dict(fc_norm=True, norm_output=True),
    "norm_before_fc": dict(norm_before_fc=True),
    "full_vocab": dict(draft_vocab_size=96),
    "mla_eagle3.1": dict(MLA, fc_norm=True, norm_output=True),
}


def make_pair(seed: int = 0, **kw) -> tuple[RefDrafter, Drafter]:
    """A reference drafter with random weights and a JAX drafter holding the same tensors."""
    d = cfg_dict(**kw)
    ref = RefDrafter(RefDrafterConfig.from_dict(d)).random_init_(seed)
    drafter = Drafter(DrafterConfig.from_hf(d, "test config"))
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    state = nnx.state(drafter)
    flat = nnx.to_flat_state(state)
    for path, leaf in flat:
        arr = sd[drafter_key(tuple(path))]
        if path[-1] == "kernel":
            arr = arr.T
        leaf.set_value(jnp.asarray(arr, leaf.get_value().dtype))
    nnx.update(drafter, nnx.from_flat_state(flat))
    drafter.set_vocab_map(sd["d2t"])
    assert np.array_equal(np.asarray(drafter.t2d[...]), sd["t2d"])
    return ref, drafter


def make_batch(ref: RefDrafter, b: int = 2, t: int = 12, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random aux / tokens / loss mask, and target logits that agree with the drafter's own step-0
    argmax at about half of the positions, so accuracies are neither 0 nor 1 and mis-shifts show."""
    g = torch.Generator().manual_seed(seed)
    c = ref.cfg
    aux = torch.randn(b, t, c.fc_in, generator=g)
    ids = torch.randint(0, c.vocab_size, (b, t), generator=g)
    mask = (torch.rand(b, t, generator=g) < 0.75).to(torch.float32)
    mask[:, :2] = 0  # a "prompt"
    with torch.no_grad():
        step0 = ref_ttt_unroll(ref, aux, ids, 1)[0]  # [B, T, Vd]: index t predicts target position t+1
    agree = torch.zeros(b, t, c.vocab_size)
    agree[:, 1:, torch.arange(c.draft_vocab_size) + ref.d2t] = 4.0 * step0[:, :-1]
    noise = 2.0 * torch.randn(b, t, c.vocab_size, generator=g)
    pick = (torch.rand(b, t, 1, generator=g) < 0.5).to(torch.float32)
    logits = pick * agree + (1 - pick) * noise
    return dict(aux=aux, input_ids=ids, target_logits=logits, loss_mask=mask)


def jax_loss_and_grads(drafter: Drafter, batch: dict, **kw):
    graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
    jb = {k: jnp.asarray(v.numpy()) for k, v in batch.items()}

    def f(p):
        out = ttt.ttt_loss(
            nnx.merge(graphdef, p, rest), jb["aux"], jb["input_ids"], jb["target_logits"], jb["loss_mask"], **kw
        )
        return out.total, out

    (_, out), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)  # one program, not hundreds of eager ops
    return out, {
        drafter_key(tuple(p)): np.asarray(v.get_value()).T if p[-1] == "kernel" else np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(grads)
    }


def ref_loss_and_grads(ref: RefDrafter, batch: dict, **kw):
    ref.zero_grad(set_to_none=True)
    total, losses, accs = ref_ttt_loss(
        ref, batch["aux"], batch["input_ids"], batch["target_logits"], batch["loss_mask"], **kw
    )
    total.backward()
    grads = {n: p.grad.numpy() for n, p in ref.named_parameters() if p.requires_grad}
    return total.item(), np.array([x.item() for x in losses]), np.array([a.item() for a in accs]), grads


CASES = [(v, n, "mask") for v in VARIANTS for n in ("all", "valid")] + [
    ("eagle3", "valid", "loss_mask"),
    ("eagle3.1", "all", "loss_mask"),
]


@pytest.mark.parametrize("variant,normalize,acc_denominator", CASES)
def test_ttt_loss_accuracy_and_gradients_match_reference(variant, normalize, acc_denominator):
    ref, drafter = make_pair(**VARIANTS[variant])
    batch = make_batch(ref)
    kw = dict(ttt_length=7, decay=0.8, normalize=normalize, acc_denominator=acc_denominator)
    out, grads = jax_loss_and_grads(drafter, batch, **kw)
    r_total, r_losses, r_accs, r_grads = ref_loss_and_grads(ref, batch, **kw)

    np.testing.assert_allclose(float(out.total), r_total, rtol=LOSS_RTOL)
    np.testing.assert_allclose(np.asarray(out.losses), r_losses, rtol=LOSS_RTOL, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(out.accuracies, np.float32), r_accs.astype(np.float32))
    assert 0.1 < r_accs[0] < 0.95, "test batch should give a non-trivial step-0 accuracy"
    # The trained set is exactly the reference's trainable set: embedding, d2t and t2d are frozen.
    assert set(grads) == set(r_grads)
    for key, g in grads.items():
        g_ref = r_grads[key]
        tol = GRAD_REL * np.abs(g_ref).max() + GRAD_ABS
        assert np.abs(g_ref).max() > 0, key
        np.testing.assert_allclose(g, g_ref, rtol=0, atol=tol, err_msg=key)


def test_unroll_longer_than_sequence_matches_reference():
    """ttt_length > T - 1: later steps have nothing to supervise (zero loss), as in the reference."""
    ref, drafter = make_pair()
    batch = make_batch(ref, t=5)
    out, grads = jax_loss_and_grads(drafter, batch, ttt_length=7, normalize="valid")
    r_total, r_losses, r_accs, r_grads = ref_loss_and_grads(ref, batch, ttt_length=7, normalize="valid")
    np.testing.assert_allclose(float(out.total), r_total, rtol=LOSS_RTOL)
    np.testing.assert_allclose(np.asarray(out.losses), r_losses, rtol=LOSS_RTOL, atol=1e-7)
    assert np.all(r_losses[4:] == 0)
    for key, g in grads.items():
        np.testing.assert_allclose(
            g, r_grads[key], rtol=0, atol=GRAD_REL * np.abs(r_grads[key]).max() + GRAD_ABS, err_msg=key
        )


# ----------------------------------------------------------------------------------- structure


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_extended_attention_equals_dense_mask_of_spec(steps):
    """Step i's attention = plain attention over [step-0 keys, step-1 keys, ..., step-i keys] under the
    The TTT mask: query j sees step-0 keys 0..j and, of each later step, only index j."""
    b, t, hq, hkv, d = 2, 6, 4, 2, 8
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (b, t, hq, d))
    k_all = jax.random.normal(ks[1], (steps, b, t, hkv, d))
    v_all = jax.random.normal(ks[2], (steps, b, t, hkv, d))
    # The diagonal buffer has 2 spare slots holding junk: they must be masked out.
    junk = 100.0 * jnp.ones((2, b, t, hkv, d))
    dk = jnp.concatenate([k_all[1:], junk]) if steps > 1 else junk
    dv = jnp.concatenate([v_all[1:], junk]) if steps > 1 else junk
    got = ttt._extended_attention(q, k_all[0], v_all[0], dk, dv, steps - 1, 1.0 / np.sqrt(d))

    j = np.arange(t)[:, None]
    blocks = [j >= np.arange(t)[None, :]] + [j == np.arange(t)[None, :]] * (steps - 1)
    mask = jnp.broadcast_to(jnp.asarray(np.concatenate(blocks, axis=1)), (b, t, steps * t))
    dense = attend(
        q, heads_first(jnp.concatenate(list(k_all), axis=1)), heads_first(jnp.concatenate(list(v_all), axis=1)), mask
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(dense), rtol=1e-5, atol=1e-6)


def test_each_step_sees_only_what_it_should():
    """Perturbation: output (step i, index j) changes with input_ids[m] iff 1 <= m <= j + 1 + i (tokens it
    or its diagonal predecessors read; input_ids[0] is shifted out) and with aux[m] iff m <= j."""
    _, drafter = make_pair(**VARIANTS["eagle3.1"])
    b, t, steps = 1, 8, 4
    rng = np.random.default_rng(0)
    aux = jnp.asarray(rng.standard_normal((b, t, drafter.config.fc_in_features)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, drafter.config.vocab_size, (b, t)), jnp.int32)
    unroll = jax.jit(lambda aux, ids: ttt.ttt_unroll(drafter, aux, ids, steps))
    base = unroll(aux, ids)  # [steps, B, T, Vd]
    i_idx, j_idx = np.meshgrid(np.arange(steps), np.arange(t), indexing="ij")
    for m in range(t):
        ids2 = ids.at[0, m].set((ids[0, m] + 1) % drafter.config.vocab_size)
        changed = np.abs(np.asarray(unroll(aux, ids2) - base)).max(-1)[:, 0] > 1e-6
        np.testing.assert_array_equal(changed, (m >= 1) & (m <= j_idx + 1 + i_idx), err_msg=f"token {m}")
        aux2 = aux.at[0, m].add(1.0)
        changed = np.abs(np.asarray(unroll(aux2, ids) - base)).max(-1)[:, 0] > 1e-6
        np.testing.assert_array_equal(changed, np.broadcast_to(m <= j_idx, changed.shape), err_msg=f"aux {m}")


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1", "mla_eagle3.1"])
def test_unroll_equals_cached_chain_drafting(variant):
    """Index j of the unroll is what chain drafting does after a prefix of j+1 target positions: step i
    at RoPE position j+i, seeing the prefix keys 0..j and the keys of its own drafted steps 1..i, and
    fed the previous step's feature (pre- or post-norm by the flag)."""
    _, drafter = make_pair(**VARIANTS[variant])
    b, t, steps = 1, 7, 4
    rng = np.random.default_rng(1)
    aux = jnp.asarray(rng.standard_normal((b, t, drafter.config.fc_in_features)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, drafter.config.vocab_size, (b, t)), jnp.int32)
    unrolled = ttt.ttt_unroll(drafter, aux, ids, steps)

    tokens = np.concatenate([np.asarray(ids), np.zeros((b, steps + 1), np.int32)], axis=1)  # zero past the end
    g0 = drafter.fuse(aux)
    size = t + steps
    cache = drafter.init_cache(b, size)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    prefix_mask = jnp.broadcast_to(jnp.arange(size)[None, :] <= jnp.arange(t)[:, None], (b, t, size))
    logits0, feat, _, cache = drafter.step(
        g0, jnp.asarray(tokens[:, 1 : t + 1]), pos, prefix_mask, cache, jnp.zeros((b,), jnp.int32)
    )
    np.testing.assert_allclose(np.asarray(logits0), np.asarray(unrolled[0]), rtol=1e-5, atol=1e-5)
    for j in range(t):
        c, g = cache, feat[:, j : j + 1]
        for i in range(1, steps):
            slot = t + i - 1
            visible = (jnp.arange(size) <= j) | ((jnp.arange(size) >= t) & (jnp.arange(size) <= slot))
            tok = jnp.asarray(tokens[:, j + 1 + i : j + 2 + i])
            lg, g, _, c = drafter.step(
                g, tok, jnp.full((b, 1), j + i, jnp.int32), visible[None, None], c, jnp.full((b,), slot, jnp.int32)
            )
            np.testing.assert_allclose(
                np.asarray(lg[:, 0]), np.asarray(unrolled[i][:, j]), rtol=1e-5, atol=1e-5, err_msg=f"step {i} index {j}"
            )


def test_simulated_acceptance_length():
    np.testing.assert_allclose(float(ttt.simulated_acceptance_length([0.8, 0.5, 0.5])), 1 + 0.8 + 0.4 + 0.2, rtol=1e-6)
    assert float(ttt.simulated_acceptance_length([0.0, 1.0])) == 1.0
    assert float(ttt.simulated_acceptance_length([1.0] * 5)) == 6.0
