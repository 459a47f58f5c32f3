"""The drafter owns the target layers it reads: drafters naming aux ids (1, 3, 5, 6), none (EAGLE's
default for the depth) and (2, 4, 6) are loaded in turn on ONE target object, and each then generates
HF's greedy tokens and drafts exactly what its PyTorch reference drafts from HF's hidden states.

Loading a drafter never changes the target: the compiled program of each pair captures the layers its
drafter asks for, so the order of loading does not matter.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import save_file

import eagle_jax
from eagle_jax.config import SpecConfig, default_aux_layer_ids
from eagle_jax.decoding.engine import Plan
from eagle_jax.decoding.prefill import prefill
from eagle_jax.decoding.sampling import RowSampling, SamplingParams
from parity_tests.conftest import hf_forward, rel_err, save_hf_model
from parity_tests.torch_reference import RefDrafter, RefDrafterConfig

LAYERS = 8
NEW = 10
DRAFTERS = {"ids_1356": [1, 3, 5, 6], "default": None, "ids_246": [2, 4, 6]}


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    """A tiny 8-layer HF Llama and three drafter checkpoints for it (random weights, seeded)."""
    root = tmp_path_factory.mktemp("aux_ownership")
    target_dir, hf = save_hf_model(root, "llama", num_hidden_layers=LAYERS, name="target")
    c = hf.config
    refs, dirs = {}, {}
    for seed, (name, ids) in enumerate(DRAFTERS.items()):
        cfg = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "hidden_size": c.hidden_size,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": c.hidden_size // 4,
            "intermediate_size": 2 * c.hidden_size,
            "num_hidden_layers": 1,
            "rms_norm_eps": 1e-6,
            "vocab_size": c.vocab_size,
            "draft_vocab_size": c.vocab_size,
            "target_hidden_size": c.hidden_size,
            "num_aux_hidden_states": 3 if ids is None else len(ids),
            "fc_norm": True,
            "norm_output": True,
        }
        if ids is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
        ref = RefDrafter(RefDrafterConfig.from_dict(cfg)).random_init_(seed=10 + seed)
        with torch.no_grad():
            ref.embed_tokens.weight.copy_(hf.model.embed_tokens.weight)
        path = root / name
        path.mkdir()
        sd = {
            k: v.detach().clone().contiguous()
            for k, v in ref.state_dict().items()
            if k not in ("embed_tokens.weight", "d2t", "t2d")
        }
        save_file(sd, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(cfg))
        refs[name], dirs[name] = ref.eval(), path
    return target_dir, hf, dirs, refs


def _prompts(vocab: int) -> list[list[int]]:
    g = np.random.default_rng(3)
    return [g.integers(0, vocab, 12).tolist(), g.integers(0, vocab, 9).tolist()]


@torch.no_grad()
def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(n):
        ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


def _prefill_draft_logits(target, drafter, prompts) -> np.ndarray:
    """The drafter's logits after the prompt, computed inside one jitted prefill program."""
    p = max(map(len, prompts))
    prompt = np.zeros((len(prompts), p), np.int32)
    for i, row in enumerate(prompts):
        prompt[i, : len(row)] = row
    lens = np.array([len(r) for r in prompts], np.int32)
    plan = Plan.one_shot(len(prompts), p, 4, SpecConfig(num_speculative_tokens=3), True, ())
    tg, ts = nnx.split(target)
    dg, ds = nnx.split(drafter)

    @jax.jit
    def run(ts, ds, prompt, lens):
        rs = RowSampling.fill(SamplingParams(0.0, 0, 1.0), len(prompts))
        keys = jax.random.split(jax.random.key(0), len(prompts))
        return prefill(nnx.merge(tg, ts), nnx.merge(dg, ds), plan, prompt, lens, rs, keys)

    pre = run(ts, ds, jnp.asarray(prompt), jnp.asarray(lens))
    return np.asarray(pre.d_logits), np.asarray(pre.first)


@torch.no_grad()
def _ref_draft_logits(hf, ref: RefDrafter, ids: tuple[int, ...], prompts) -> np.ndarray:
    """The reference: HF's hidden_states at the drafter's layers, the pairs (feature t, token t+1)."""
    out = []
    for row in prompts:
        logits, hs = hf_forward(hf, np.array([row]))
        first = int(logits[0, -1].argmax())
        aux = torch.cat([hs[i] for i in ids], dim=-1)
        nxt = torch.tensor([row[1:] + [first]])
        draft_logits, _ = ref(aux, nxt)
        out.append(draft_logits[0, -1].numpy())
    return np.stack(out)


def test_one_target_many_drafters_any_order(pair_dirs):
    target_dir, hf, dirs, refs = pair_dirs
    target = eagle_jax.load_target(target_dir, dtype="float32")
    config_before = target.config
    weights_before = jax.tree.map(np.asarray, nnx.state(target))
    prompts = _prompts(hf.config.vocab_size)
    want = [_hf_greedy(hf, p, NEW) for p in prompts]

    order = ["ids_1356", "default", "ids_246"]
    drafters = {name: eagle_jax.load_drafter(dirs[name], target) for name in order}
    assert target.config == config_before and not hasattr(target, "aux_layer_ids")
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(target)), weights_before)

    results = {}
    for name in reversed(order):  # used in the reverse order of loading
        drafter = drafters[name]
        ids = tuple(sorted(DRAFTERS[name] or default_aux_layer_ids(LAYERS)))
        assert drafter.config.aux_layer_ids == ids
        d_logits, first = _prefill_draft_logits(target, drafter, prompts)
        ref = _ref_draft_logits(hf, refs[name], ids, prompts)
        assert first.tolist() == [w[0] for w in want]
        err = rel_err(d_logits, ref)
        assert err <= 1e-5, (
            f"{name}: drafter logits over the target's layers {ids} differ from the reference: {err:.2e}"
        )
        out = eagle_jax.generate(
            target, drafter, prompts, max_new_tokens=NEW, spec={"num_speculative_tokens": 3}, eos_token_id=[]
        )
        assert out.tokens == want, f"{name}: speculative greedy != HF greedy"
        results[name] = (out.tokens, out.accepted)

    # Loaded again, in another order, after the others: the same drafts, the same acceptance.
    for name in ["ids_246", "ids_1356", "default"]:
        again = eagle_jax.load_drafter(dirs[name], target)
        out = eagle_jax.generate(
            target, again, prompts, max_new_tokens=NEW, spec={"num_speculative_tokens": 3}, eos_token_id=[]
        )
        assert (out.tokens, out.accepted) == results[name], f"{name}: results depend on the order drafters were loaded"
