"""SpecForge's ``norm_output`` against eagle_jax's, and the load-time override that reconciles them.

Two trainers write the same EAGLE-3.1 config key with different meanings:

- vLLM, SGLang, TorchSpec, eagle_jax (``Drafter.layer``) and the torch reference (``RefDrafter``):
  ``norm_output: true`` feeds RMSNorm_final(h2) to the next draft step; the lm_head always sees
  RMSNorm_final(h2).
- SpecForge's trainer from its EAGLE-3.1 support (sgl-project/SpecForge PR #568) until its fix
  (PR #879): ``LlamaForCausalLMEagle3.compute_logits`` applies the final norm before lm_head iff
  ``norm_output`` (default true), and the TTT loop (``specforge/algorithms/eagle3/model.py``) feeds
  the backbone output, the PRE-norm h2, to the next step whatever the flag. Its EAGLE-3.1 config
  (``configs/qwen3-30B-A3B-eagle3.1.json``) says ``fc_norm: true, norm_output: true``: a drafter trained
  with per-chunk fc norms, normed lm_head input and pre-norm feedback.

That computation is exactly the reference with ``fc_norm=True, norm_output=False`` (same layer, same
norm placement before lm_head; only the fed-back feature differs), so it serves as the SpecForge
reference here. The test writes such a checkpoint as SpecForge exports it (config.json with
``fc_norm: true, norm_output: true``; every tensor of the model, target embedding and d2t/t2d
included), loads it into eagle_jax with and without ``overrides={"norm_output": False}``, and chains
draft steps on each model's own features:

- with the override, every draft step's logits match the SpecForge reference (fp32 rel err <= 1e-5);
- without it, the first draft step still matches (it reads target features only), and every later
  step differs measurably: the silent mismatch a user would otherwise only see as lower acceptance.

Skipped (with the reason) while ``eagle_jax.load_drafter`` has no ``overrides`` parameter.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import eagle_jax
from parity_tests.conftest import rel_err, save_hf_model
from parity_tests.torch_reference import RefDrafter, RefDrafterConfig

V, HT = 128, 64  # conftest.TINY target: vocabulary, hidden size (4 layers)
B, T, CHAIN = 2, 8, 4  # batch; prefill block on target features; chained steps on own features
TOL = 1e-5  # fp32 parity
MISMATCH = 1e-2  # rel err that counts as "measurably different" (>= 1000x the parity tolerance)

# A SpecForge EAGLE-3.1 draft config (the layout of its configs/qwen3-30B-A3B-eagle3.1.json), sized
# for the tiny target. SpecForge's fc reads exactly 3 aux states.
SPECFORGE_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "hidden_size": HT,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "num_hidden_layers": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "vocab_size": V,
    "draft_vocab_size": V,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "fc_norm": True,
    "norm_output": True,
}


def specforge_reference_config(cfg: dict) -> RefDrafterConfig:
    """The reference config that computes what SpecForge (PR #568 .. PR #879) trained for ``cfg``.

    SpecForge ``norm_output: true`` = final norm before lm_head + pre-norm h2 fed forward = the
    reference's EAGLE-3 feedback (``norm_output=False``). SpecForge ``norm_output: false`` (no norm
    before lm_head at all) has no counterpart in the reference or in eagle_jax.
    """
    if not cfg.get("norm_output", True):
        raise ValueError("SpecForge norm_output=false (lm_head on the un-normed state) is not an EAGLE-3/3.1 drafter")
    return RefDrafterConfig.from_dict({**cfg, "norm_output": False})


def write_specforge_checkpoint(ref: RefDrafter, cfg: dict, path: Path) -> None:
    """config.json + model.safetensors with every tensor SpecForge's export writes (its key names are
    the reference's: ``midlayer.*``, ``fc.weight``, ``fc_norm.{i}.weight``, ``norm.weight``, ``lm_head.weight``,
    ``embed_tokens.weight`` = the target's, ``d2t``, ``t2d``)."""
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().clone().contiguous() for k, v in ref.state_dict().items()}, str(path / "model.safetensors")
    )
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def np32(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float32).numpy()
    return np.asarray(jax.device_get(x)).astype(np.float32)


def dev(x, dtype=None) -> jax.Array:
    x = np.asarray(x)
    return jax.device_put(x if dtype is None else x.astype(dtype))


def slot_mask(q_pos: np.ndarray, slots: int) -> jax.Array:
    """[B, Tq, S] causal mask over cache slots (slot s holds position s)."""
    return dev(np.arange(slots)[None, None, :] <= q_pos[:, :, None])


@torch.no_grad()
def reference_draft(ref: RefDrafter, aux: torch.Tensor, ids: torch.Tensor):
    """Draft logits of steps 1..CHAIN+1 (each [B, Vd]) and the tokens drafted, the reference chaining
    its own features: step 1 = last position of the prefill block on target features."""
    pos = torch.arange(T)[None].expand(B, T)
    logits, feat, kv = ref.step(ref.fuse(aux), ids, pos)
    out, tokens = [logits[:, -1]], []
    feat = feat[:, -1:]
    for i in range(CHAIN):
        token = ref.draft_to_target(logits[:, -1].argmax(-1))[:, None]
        logits, feat, kv = ref.step(feat, token, torch.full((B, 1), T + i), past_kv=kv)
        out.append(logits[:, -1])
        tokens.append(token)
    return out, tokens


def jax_draft(drafter, aux: np.ndarray, ids: np.ndarray, tokens: list[torch.Tensor]) -> list[np.ndarray]:
    """The same chain through eagle_jax's cached ``Drafter.step``, fed the reference's tokens (so a
    logit difference cannot come from a different token choice)."""
    slots = T + CHAIN
    pos = np.broadcast_to(np.arange(T), (B, T))
    cache = drafter.init_cache(B, slots)
    logits, feat, _, cache = drafter.step(
        drafter.fuse(dev(aux)),
        dev(ids, np.int32),
        dev(pos, np.int32),
        slot_mask(pos, slots),
        cache,
        dev(np.zeros(B, np.int32)),
    )
    out = [np32(logits)[:, -1]]
    feat = feat[:, -1:]
    for i, token in enumerate(tokens):
        p = np.full((B, 1), T + i)
        logits, feat, _, cache = drafter.step(
            feat,
            dev(token.numpy(), np.int32),
            dev(p, np.int32),
            slot_mask(p, slots),
            cache,
            dev(np.full(B, T + i, np.int32)),
        )
        out.append(np32(logits)[:, -1])
    return out


@torch.no_grad()
def test_specforge_norm_output_needs_override(tmp_path, record_error):
    if "overrides" not in inspect.signature(eagle_jax.load_drafter).parameters:
        pytest.skip("eagle_jax.load_drafter has no 'overrides' parameter yet (needed for SpecForge 3.1 checkpoints)")

    hf_dir, hf_model = save_hf_model(tmp_path, "llama", seed=0, name="llama_target")
    target = eagle_jax.load_target(hf_dir, dtype="float32")

    ref = RefDrafter(specforge_reference_config(SPECFORGE_CONFIG)).random_init_(seed=31)
    ref.embed_tokens.weight.copy_(hf_model.model.embed_tokens.weight.detach().float())
    ckpt = tmp_path / "specforge-eagle3.1"
    write_specforge_checkpoint(ref, SPECFORGE_CONFIG, ckpt)
    ref.eval()

    as_written = eagle_jax.load_drafter(ckpt, target, dtype="float32")
    overridden = eagle_jax.load_drafter(ckpt, target, dtype="float32", overrides={"norm_output": False})
    assert (as_written.config.fc_norm, as_written.config.norm_output) == (True, True)
    assert (overridden.config.fc_norm, overridden.config.norm_output) == (True, False)
    assert overridden.config.aux_layer_ids == as_written.config.aux_layer_ids

    # inputs: the target's aux states at the layers the drafter reads; feature t pairs with x_{t+1}
    prompt = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(7))
    _, aux = target(dev(prompt[:, :T].numpy(), np.int32), overridden.config.aux_layer_ids)
    aux32 = np32(aux)
    ids = prompt[:, 1:]

    ref_logits, tokens = reference_draft(ref, torch.from_numpy(aux32), ids)
    results = {
        "override": jax_draft(overridden, aux32, ids.numpy(), tokens),
        "as_written": jax_draft(as_written, aux32, ids.numpy(), tokens),
    }
    errs = {
        name: [
            record_error(f"{name}_draft_step{s + 1}_logits", rel_err(j, r))
            for s, (j, r) in enumerate(zip(got, ref_logits))
        ]
        for name, got in results.items()
    }

    assert len(ref_logits) == CHAIN + 1 and CHAIN >= 3
    bad = [f"step {s + 1}: {e:.2e}" for s, e in enumerate(errs["override"]) if not e <= TOL]
    assert not bad, (
        f"with overrides={{'norm_output': False}} eagle_jax != SpecForge reference (rel err > {TOL:g}): {bad}"
    )
    # Without the override the first draft step (target features only) agrees, every chained step does not.
    assert errs["as_written"][0] <= TOL, f"step 1 should not depend on the feedback: {errs['as_written'][0]:.2e}"
    quiet = [f"step {s + 2}: {e:.2e}" for s, e in enumerate(errs["as_written"][1:]) if not e > MISMATCH]
    assert not quiet, f"loading as written should visibly differ from the SpecForge reference from step 2 on: {quiet}"
    print(
        "[norm_output] rel err per draft step vs SpecForge reference: "
        + "; ".join(f"{n}: " + ", ".join(f"{e:.1e}" for e in es) for n, es in errs.items())
    )
