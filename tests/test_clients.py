"""The standard clients against a real server, run as their users run them.

- lm-evaluation-harness 0.4.13, ``--model local-completions``, on three tasks this test writes (multiple
  choice, ``loglikelihood_rolling``, ``generate_until``), with token-id prompts (tokenized through the
  server: its remote tokenizer backend) and with text prompts: per sample
  what its ``hf`` backend gives on the same weights (the Markov target saved as an HF Llama checkpoint).
  Log-likelihoods agree within 1e-3 + 1e-5 relative (float32 on both sides; observed ~1e-6: one forward each,
  summed in another order), is_greedy flags and greedy texts exactly.
- The same lm-eval comparison for a Gemma 3 target (a tiny random HF ``Gemma3ForCausalLM``: windows of 8 on
  sliding layers, a global layer, (1 + w) norms) served alone, as ``eagle-jax-serve --target DIR --drafter none``
  loads it: the rolling windows and prompts run past its sliding window.
- guidellm 0.8.1, its concurrent profile with streaming (its default), completes every request with 0
  errors.

Both clients come from the ``clients`` extra (installed by the README's test command); without it
these tests skip, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from engine_models import markov_drafter, markov_target
from serving_models import VOCAB, build_tokenizer

import eagle_jax
from bench.lm_eval_parity import TASKS, compare, hf_model_args, samples, write_tasks
from eagle_jax import SpecConfig
from eagle_jax.serving import SpecSchedule
from eagle_jax.serving.server import Server, make_service

MODEL = "markov"
MAX_LEN = 128
# lm-eval's two backends cut loglikelihood_rolling windows differently: max_length - 2 tokens scored per
# window by the API backend (which also asks for one new token), max_length by the hf backend. API
# max_length 128 (the server's context) and hf max_length 126 give both the same windows.
HF_EVAL_LEN = MAX_LEN - 2

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install -e '.[clients]')")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The Markov pair behind a server (chain K=2), its target also saved as an HF checkpoint with a
    tokenizer whose BOS (lm-eval's rolling-window prefix) is in the model's vocabulary."""
    root = tmp_path_factory.mktemp("clients")
    target, succ = markov_target(vocab=VOCAB, hidden=64, seed=0, eps=0.1)
    drafter, _ = markov_drafter(target, succ, seed=0, disagree=0.25)
    tok = build_tokenizer()
    tok.bos_token = "<pad>"  # id VOCAB - 1
    eagle_jax.save_target(target, root / "target")
    tok.save_pretrained(root / "target")
    service = make_service(
        target,
        drafter,
        tok,
        SpecSchedule.fixed(SpecConfig(num_speculative_tokens=2)),
        (),
        slots=2,
        max_len=MAX_LEN,
        rounds_per_step=2,
        model_name=MODEL,
        precompile=False,
    )
    server = Server(service).start()
    yield server, root / "target"
    server.stop()


@pytest.fixture(scope="module")
def served_gemma3(tmp_path_factory):
    """A tiny random Gemma 3 checkpoint (HF format, built by transformers) served without a drafter through
    ``build_service``, the command line's path; the same directory is lm-eval's ``hf`` reference."""
    from eagle_jax.serving.server import build_service
    from parity_tests.test_gemma3 import build_gemma3

    root = tmp_path_factory.mktemp("clients-gemma3") / "target"
    # the parity tests' tiny Gemma 3 (windows of 8 beside a global layer) over this tokenizer's vocabulary
    build_gemma3(
        vocab_size=VOCAB, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 1
    ).save_pretrained(root)
    tok = build_tokenizer()
    tok.bos_token = "<pad>"
    tok.save_pretrained(root)
    service = build_service(root, None, slots=2, max_len=MAX_LEN, rounds_per_step=2, model_name=MODEL, precompile=False)
    server = Server(service).start()
    yield server, root
    server.stop()


def test_lm_eval_local_completions_equals_its_hf_backend(served, tmp_path, monkeypatch):
    _check_local_completions_against_hf(*served, tmp_path, monkeypatch)


def test_lm_eval_on_a_served_gemma3_equals_its_hf_backend(served_gemma3, tmp_path, monkeypatch):
    _check_local_completions_against_hf(*served_gemma3, tmp_path, monkeypatch)


def _check_local_completions_against_hf(server, hf_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    tasks_dir = write_tasks(tmp_path, TASKS)
    reference = samples("hf", hf_model_args(str(hf_dir), HF_EVAL_LEN), tasks_dir, list(TASKS))
    base = f"model={MODEL},base_url={server.url}/v1/completions,max_length={MAX_LEN},num_concurrent=1,max_retries=1"
    # Token-id prompts tokenized through the server (/tokenizer_info, /tokenize, /detokenize), and text prompts.
    for tokenized, tokenizer in (
        (True, "tokenizer_backend=remote"),
        (False, f"tokenizer_backend=huggingface,tokenizer={hf_dir}"),
    ):
        got = samples("local-completions", f"{base},{tokenizer},tokenized_requests={tokenized}", tasks_dir, list(TASKS))
        agreement = compare(reference, got)
        assert agreement["responses"] > 0 and not agreement["mismatches"], (tokenized, agreement["mismatches"])
        print(
            f"lm-eval local-completions vs hf, tokenized_requests={tokenized}: largest log-likelihood difference "
            f"{agreement['max_abs']:.2e} ({agreement['max_rel']:.2e} relative past 1)"
        )


@pytest.mark.parametrize("temperature", [None, 0.0], ids=["default_temperature", "greedy"])
def test_guidellm_concurrent_streaming_completes_without_errors(served, tmp_path, temperature):
    """As guidellm runs by default (no temperature sent: the API's 1.0), and greedy through its backend's
    ``extras`` (fields merged into every request body)."""
    server, hf_dir = served
    exe = Path(sys.executable).with_name("guidellm")
    if not exe.exists():
        pytest.skip("guidellm is not installed (pip install -e '.[clients]')")
    out = tmp_path / "guidellm.json"
    backend = {"kind": "openai_http", "target": server.url, "model": MODEL}
    if temperature is not None:
        backend["extras"] = {"body": {"temperature": temperature}}
    cmd = [
        str(exe),
        "run",
        "--backend",
        json.dumps(backend),
        "--profile",
        "kind=concurrent,streams=2",
        "--constraint",
        "kind=max_requests,count=6",
        "--data",
        "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
        "--tokenizer",
        f"kind=huggingface_auto,model={hf_dir}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    bench = json.loads(out.read_text())["benchmarks"][0]
    requests = bench["requests"]
    assert len(requests["errored"]) == 0 and len(requests["incomplete"]) == 0
    assert len(requests["successful"]) == 6
    first = requests["successful"][0]
    sent = json.loads(first["request_args"])
    assert sent["stream"] is True  # streamed, as guidellm runs by default
    assert sent.get("body", sent).get("temperature") == temperature, sent
    assert all(r["output"] for r in requests["successful"])
