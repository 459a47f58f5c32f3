"""Shared fixtures and helpers of the JAX-vs-PyTorch parity tests.

- ``device``: every parity test runs on "cpu"; the "cuda" case runs only where both PyTorch sees a
  GPU and JAX has a gpu backend, and is skipped (with the reason) otherwise.
- ``rel_err``: the error norm all tolerances here refer to (max-abs relative error).
- ``save_hf_model``: tiny seeded random HF Llama / Qwen2 / Qwen3 / Mistral checkpoints, in the three
  on-disk formats a target can come in (single safetensors, sharded safetensors + index, .bin).
- ``record_error``: tests report their measured errors through it; at the end of the session they are
  written to ``parity_tests/.last_parity_errors.json`` (test name -> max rel err and the details).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

ERRORS_FILE = Path(__file__).resolve().parent / ".last_parity_errors.json"

# ------------------------------------------------------------------------------------------- devices


def _cuda_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "cuda parity case needs a GPU: torch.cuda.is_available() is False"
    try:
        jax.devices("gpu")
    except RuntimeError as e:
        return f"cuda parity case needs a JAX gpu backend: jax.devices('gpu') raised ({e})"
    return None


CUDA_SKIP_REASON = _cuda_skip_reason()


@pytest.fixture(
    params=[
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=CUDA_SKIP_REASON or "")),
    ]
)
def device(request):
    """The device name ("cpu" / "cuda") for torch; JAX arrays created in the test land on the matching
    backend. fp32 matmuls run at full precision on both sides (no TF32), so fp32 tolerances hold on GPU."""
    name = request.param
    if name == "cpu" and jax.default_backend() == "cpu":
        # Nothing to switch. Entering jax.default_device / default_matmul_precision would change JAX's
        # compilation-cache keys and make every eager op recompile for tests that take no ``device``.
        yield name
        return
    jax_dev = jax.devices("cpu" if name == "cpu" else "gpu")[0]
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with jax.default_device(jax_dev), jax.default_matmul_precision("highest"):
            yield name
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32


# --------------------------------------------------------------------------------------------- norms


def to_numpy64(x) -> np.ndarray:
    """A torch tensor or JAX/numpy array as float64 numpy (bf16 included)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(jax.device_get(x)).astype(np.float64)


def rel_err(a, b) -> float:
    """Max-abs relative error of ``a`` against the reference ``b``: ``max|a - b| / max|b|``.

    Both are converted to float64 first; the norm is over all elements (a single worst element
    decides), relative to the largest magnitude of the reference.
    """
    a, b = to_numpy64(a), to_numpy64(b)
    assert a.shape == b.shape, f"shape mismatch {a.shape} vs {b.shape}"
    denom = float(np.max(np.abs(b)))
    return float(np.max(np.abs(a - b))) / (denom if denom > 0 else 1.0)


# ---------------------------------------------------------------------------------- error collection


@pytest.fixture(scope="session")
def parity_errors():
    """Session collector: test name -> {label: rel err}; written to ERRORS_FILE at session end.

    Entries of tests not run in this session are kept (separate runs of different test files add up);
    a test run again replaces its entry.
    """
    collected: dict[str, dict[str, float]] = {}
    yield collected
    if not collected:
        return
    # Test workers (pytest-xdist) finish at the same time: read-merge-write under an exclusive lock.
    with open(ERRORS_FILE.with_name(ERRORS_FILE.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            out = json.loads(ERRORS_FILE.read_text())
        except (OSError, ValueError):
            out = {}
        for name, d in collected.items():
            out[name] = {"max_rel_err": max(d.values()), "details": dict(sorted(d.items()))}
        tmp = ERRORS_FILE.with_name(f"{ERRORS_FILE.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dict(sorted(out.items())), indent=2) + "\n")
        tmp.replace(ERRORS_FILE)


@pytest.fixture
def record_error(request, parity_errors):
    """``record_error(label, err)``: prints the measured error and stores it under this test's name."""
    name = request.node.name

    def record(label: str, err: float) -> float:
        err = float(err)
        print(f"[parity] {name} {label}: max-abs rel err {err:.3e}")
        parity_errors.setdefault(name, {})[label] = err
        return err

    return record


# ------------------------------------------------------------------------------------ tiny HF models

ARCHS = ("llama", "qwen2", "qwen3", "mistral")

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def _hf_classes(arch: str):
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[arch]


def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Seeded O(1)-activation weights. Norm weights (HF inits them to 1, which would hide a norm that is
    skipped or applied twice) become 1 + 0.3 N(0,1); biases 0.2 N(0,1); embeddings N(0,1); every other
    matrix N(0, 1/fan_in). Tied lm_head/embedding are one parameter and stay tied."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.3 * noise
            elif name.endswith(".bias"):
                value = 0.2 * noise
            elif "embed_tokens" in name:
                value = noise
            else:
                value = noise / math.sqrt(p.shape[-1])
            p.copy_(value.to(p.dtype))
    return model


def build_hf_model(arch: str, dtype: torch.dtype = torch.float32, *, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random HF causal LM (eager attention, eval mode) of family ``arch``."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    cfg_cls, model_cls = _hf_classes(arch)
    kw = dict(TINY)
    if arch == "mistral":
        kw["sliding_window"] = 8  # shorter than the test sequences, so the window matters
    kw.update(overrides)
    config = cfg_cls(**kw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config)
    randomize_(model, seed)
    return model.to(dtype).eval()


def save_hf_model(
    tmp_path: Path,
    arch: str,
    dtype: torch.dtype = torch.float32,
    *,
    fmt: str = "safetensors",
    seed: int = 0,
    name: str | None = None,
    **overrides,
) -> tuple[Path, torch.nn.Module]:
    """Builds ``build_hf_model(arch, dtype, seed=seed, **overrides)``, saves it under tmp_path and returns
    it as ``AutoModelForCausalLM.from_pretrained`` loads it back (eager attention).

    fmt: "safetensors" (one model.safetensors), "sharded" (``max_shard_size="20KB"``: several
    model-0000x-of-0000y.safetensors plus model.safetensors.index.json) or "bin" (pytorch_model.bin).
    transformers 5 ignores ``safe_serialization=False`` and always writes safetensors, so the .bin is
    written with ``torch.save`` of the state dict. Returns (directory, HF model).
    """
    model = build_hf_model(arch, dtype, seed=seed, **overrides)
    path = Path(tmp_path) / (name or f"{arch}_{fmt}_{str(dtype).replace('torch.', '')}")
    if fmt == "safetensors":
        model.save_pretrained(path)
    elif fmt == "sharded":
        model.save_pretrained(path, max_shard_size="20KB")
        assert (path / "model.safetensors.index.json").exists(), "max_shard_size did not shard the checkpoint"
    elif fmt == "bin":
        model.save_pretrained(path)
        for f in path.glob("*.safetensors"):
            f.unlink()
        (path / "model.safetensors.index.json").unlink(missing_ok=True)
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        torch.save(state, path / "pytorch_model.bin")
    else:
        raise ValueError(f"fmt must be 'safetensors', 'sharded' or 'bin', got {fmt!r}")
    # The reference is what transformers makes of the files: reloading matters in half precision, where
    # ``model.to(bf16)`` would also round the rotary ``inv_freq`` buffer that from_pretrained keeps fp32.
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return path, reloaded.eval()


@torch.no_grad()
def hf_forward(model: torch.nn.Module, input_ids: np.ndarray, device: str = "cpu"):
    """(logits [B,T,V], hidden_states tuple of L+1 [B,T,H]) as torch tensors on the CPU."""
    model = model.to(device)
    out = model(input_ids=torch.tensor(np.asarray(input_ids), device=device), output_hidden_states=True)
    return out.logits.cpu(), tuple(h.cpu() for h in out.hidden_states)
