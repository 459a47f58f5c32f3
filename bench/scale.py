"""Real size without weights: compile ``generate``'s program for Llama-3.1-8B and its EAGLE-3 drafter.

    python -m bench.scale                                 # Llama-3.1-8B + EAGLE3-LLaMA3.1-Instruct-8B shapes, bf16
    python -m bench.scale --model tiny --dtype float32    # the bundled pair's shape: seconds
    python -m bench.scale --weights native widened        # bf16 weight matrices stored as bf16 vs as float32 (below)

The models are built abstractly (``nnx.eval_shape``: shapes and dtypes, no weights, no memory), and the
program ``eagle_jax.generate`` compiles (prefill, drafter prefill, the while_loop of rounds: the same
``prefill.start`` + ``engine.run_rounds`` over ``Plan.one_shot``) is lowered from ShapeDtypeStructs and
compiled for this machine's backend, for chain K and tree speculation at each batch (a prompt of
``--prompt-len`` tokens padded to generate's bucket, ``--max-new`` new tokens). Per program: compile
time and XLA's memory analysis (argument = the weights and inputs, output, temporaries, generated
code), next to the KV caches (target + drafter, in the plan's cache length) for reference.

Columns: weights as stored; "of which hoisted f32 weights": the part of the temporaries that is float32
copies of bf16/f16 weight matrices made outside the while loop (read from the optimized HLO); temp / KV:
temporaries over the KV caches; code: XLA's generated code size (0 on the CPU backend, which does not
report it).

``--weights``: where half-precision weight matrices live (``eagle_jax.modeling.layers.widen_half_weights``):
``auto`` the library's rule (float32-stored on the CPU backend, native elsewhere), ``native`` or
``widened`` forced, to compare both in one run. JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.common import print_table, spec_name, write_json
from eagle_jax.config import DrafterConfig, SpecConfig, TargetConfig
from eagle_jax.decoding.calls import bucket
from eagle_jax.decoding.engine import Plan, run_rounds
from eagle_jax.decoding.prefill import start
from eagle_jax.decoding.sampling import RowSampling, SamplingParams
from eagle_jax.modeling import layers
from eagle_jax.modeling.drafter import Drafter
from eagle_jax.modeling.target import Target

GIB = 1024**3

# meta-llama/Llama-3.1-8B-Instruct config.json (the fields eagle_jax reads).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16",
}

# The shape of yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: one Llama layer over 3 aux states, draft vocabulary 32000.
EAGLE3_LLAMA31_8B = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 1,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 2048,
    "vocab_size": 128256,
    "draft_vocab_size": 32000,
    "num_aux_hidden_states": 3,
}

# The bundled pair's shape (assets/target, assets/drafter-eagle3.1).
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 6144,
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 12,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "eos_token_id": 4,
}
TINY_DRAFTER = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "hidden_size": 384,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 1024,
    "num_hidden_layers": 1,
    "rms_norm_eps": 1e-5,
    "vocab_size": 6144,
    "draft_vocab_size": 2048,
    "target_hidden_size": 384,
    "num_aux_hidden_states": 3,
    "fc_norm": True,
    "norm_output": True,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 6, 9]},
}

MODELS = {"llama3.1-8b": (LLAMA31_8B, EAGLE3_LLAMA31_8B), "tiny": (TINY, TINY_DRAFTER)}
WEIGHTS = {"auto": None, "native": False, "widened": True}


def configs(model: str) -> tuple[TargetConfig, DrafterConfig]:
    t, d = MODELS[model]
    return TargetConfig.from_hf(t, f"bench.scale {model} target"), DrafterConfig.from_hf(
        d, f"bench.scale {model} drafter"
    )


def abstract_pair(tc: TargetConfig, dc: DrafterConfig, dtype) -> tuple:
    """(target graph, abstract target state, drafter graph, abstract drafter state): ShapeDtypeStruct
    leaves in ``dtype``, as ``load_target`` / ``load_drafter`` would build them; no weight exists."""
    target = nnx.eval_shape(lambda: Target(tc, dtype=dtype, rngs=nnx.Rngs(0)))
    drafter = nnx.eval_shape(lambda: Drafter(dc, dtype=dtype, rngs=nnx.Rngs(1)))
    return (*nnx.split(target), *nnx.split(drafter))


def lower_generate(t_graph, t_state, d_graph, d_state, plan: Plan, prompt_bucket: int):
    """The program ``eagle_jax.generate`` compiles for ``plan``, lowered from abstract arguments (the
    ``program`` closure of generate.py, rebuilt from the engine's pieces)."""

    def program(t_state, d_state, prompt, lens, rs, key):
        tgt = nnx.merge(t_graph, t_state)
        drf = None if d_graph is None else nnx.merge(d_graph, d_state)
        st = start(tgt, drf, plan, prompt, lens, rs, key, plan.max_rounds)
        return run_rounds(tgt, drf, plan, st, jnp.int32(plan.max_rounds))

    b = plan.batch
    args = (
        t_state,
        d_state,
        jax.ShapeDtypeStruct((b, prompt_bucket), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.eval_shape(lambda: RowSampling.fill(SamplingParams(), b)),
        jax.eval_shape(lambda: jax.random.key(0)),
    )
    return jax.jit(program).lower(*args)


def state_bytes(state) -> int:
    return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state)))


def kv_cache_bytes(tc: TargetConfig, dc: DrafterConfig, plan: Plan, dtype) -> int:
    """Target + drafter KV caches of ``plan`` (keys and values, every layer) in ``dtype``."""
    item = jnp.dtype(dtype).itemsize
    per_slot = 2 * (tc.num_layers * tc.num_kv_heads * tc.head_dim + dc.num_kv_heads * dc.head_dim)
    return int(plan.batch * plan.cache_len * per_slot * item)


_ENTRY = re.compile(r"^ENTRY .*?^}", re.M | re.S)
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]\S* (\w[\w-]*)\(([^)]*)\)", re.M)
_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2}


def hoisted_widening_bytes(hlo_text: str) -> int:
    """Bytes of the float32 copies of half-precision weight matrices that the optimized program's entry
    computation makes: a single-operand instruction (a convert, or a fusion around one) reading a
    bf16/f16 parameter of rank >= 2 and producing as many f32 elements. Such copies outside the while
    loop are the weights' widening that XLA hoisted out of the loop; they live as temporaries for the
    whole program."""
    m = _ENTRY.search(hlo_text)
    if m is None:
        return 0
    half_params = {}
    total = 0
    for name, dt, dims, op, operands in _INSTR.findall(m.group(0)):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        if op == "parameter" and dt in ("bf16", "f16") and "," in dims:  # matrices; norm vectors are negligible
            half_params[name] = n
        elif dt == "f32" and op in ("convert", "fusion") and "," not in operands:
            src = operands.strip().lstrip("%")
            if half_params.get(src) == n:
                total += 4 * n
    return total


def plan_for(tc: TargetConfig, spec: SpecConfig | None, batch: int, prompt_len: int, max_new: int) -> Plan:
    """generate's plan: greedy, the prompt padded to its bucket, the target's own EOS ids."""
    eos = tc.eos_token_id
    eos_ids = tuple(sorted(eos)) if isinstance(eos, tuple) else (() if eos is None else (int(eos),))
    return Plan.one_shot(batch, bucket(prompt_len), max_new, spec, True, eos_ids)


def measure(
    tc: TargetConfig,
    dc: DrafterConfig,
    dtype: str,
    spec: SpecConfig,
    batch: int,
    prompt_len: int,
    max_new: int,
    weights: str = "auto",
    hlo: bool = True,
) -> dict:
    """Compiles one generate program of the pair abstractly; returns its sizes (bytes) and compile time.
    ``weights``: a key of ``WEIGHTS`` (where half-precision weight matrices live while building)."""
    dt = jnp.dtype(dtype).type
    with layers.half_weights_widened(WEIGHTS[weights]):
        t_graph, t_state, d_graph, d_state = abstract_pair(tc, dc, dt)
    plan = plan_for(tc, spec, batch, prompt_len, max_new)
    p = bucket(prompt_len)
    t0 = time.perf_counter()
    lowered = lower_generate(t_graph, t_state, d_graph, d_state, plan, p)
    lower_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    row = {
        "dtype": dtype,
        "weights": weights,
        "backend": jax.default_backend(),
        "spec": spec_name(spec),
        "batch": batch,
        "prompt_bucket": p,
        "max_new": max_new,
        "cache_len": plan.cache_len,
        "lower_s": lower_s,
        "compile_s": compile_s,
        "weight_bytes": state_bytes(t_state) + state_bytes(d_state),
        "kv_cache_bytes": kv_cache_bytes(tc, dc, plan, dt),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "generated_code_bytes": int(mem.generated_code_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
    }
    row["hoisted_widening_bytes"] = hoisted_widening_bytes(compiled.as_text()) if hlo else 0
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3.1-8b", choices=sorted(MODELS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument(
        "--weights",
        nargs="+",
        default=["auto"],
        choices=sorted(WEIGHTS),
        help="where half-precision kernels live: auto (the library's rule), native, widened",
    )
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--ks", type=int, nargs="*", default=[5])
    ap.add_argument("--trees", nargs="*", default=["8,5,48"], help="top_k,depth,total_tokens")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--max-new", type=int, default=1024)
    ap.add_argument("--out", default="bench/results/scale.json")
    args = ap.parse_args(argv)

    specs = [SpecConfig(num_speculative_tokens=k) for k in args.ks]
    for t in args.trees:
        k, d, n = (int(x) for x in t.split(","))
        specs.append(SpecConfig(method="tree", tree_top_k=k, tree_depth=d, tree_total_tokens=n))
    tc, dc = configs(args.model)
    print(
        f"{args.model}: target {tc.num_layers}x{tc.hidden_size}, vocab {tc.vocab_size}; drafter {dc.hidden_size}, "
        f"draft vocab {dc.draft_vocab_size}; {args.dtype}; backend {jax.default_backend()}; prompt {args.prompt_len} "
        "-> bucket "
        f"{bucket(args.prompt_len)}, {args.max_new} new tokens"
    )
    unit, unit_name = (GIB, "GiB") if args.model != "tiny" else (2**20, "MiB")
    runs, rows = [], []
    for weights in args.weights:
        for spec in specs:
            for b in args.batch:
                r = {
                    "model": args.model,
                    **measure(tc, dc, args.dtype, spec, b, args.prompt_len, args.max_new, weights),
                }
                runs.append(r)
                rows.append(
                    [
                        weights,
                        r["spec"],
                        b,
                        f"{r['compile_s']:.1f}",
                        *(
                            f"{r[k] / unit:.2f}"
                            for k in (
                                "weight_bytes",
                                "argument_bytes",
                                "output_bytes",
                                "temp_bytes",
                                "hoisted_widening_bytes",
                                "kv_cache_bytes",
                            )
                        ),
                        f"{r['temp_bytes'] / max(r['kv_cache_bytes'], 1):.2f}",
                        f"{r['generated_code_bytes'] / 2**20:.1f}",
                    ]
                )
                print(f"  {weights} {r['spec']} batch {b}: compiled in {r['compile_s']:.1f} s", flush=True)
    print_table(
        [
            "weights",
            "speculation",
            "batch",
            "compile s",
            *(
                f"{c} {unit_name}"
                for c in ("weights", "argument", "output", "temp", "of which hoisted f32 weights", "KV cache")
            ),
            "temp / KV",
            "code MiB",
        ],
        rows,
    )
    out = {
        "model": args.model,
        "dtype": args.dtype,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "target": MODELS[args.model][0],
        "drafter": MODELS[args.model][1],
        "runs": runs,
    }
    write_json(args.out, out)
    return out


if __name__ == "__main__":
    main()
