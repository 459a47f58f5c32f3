"""Shared pieces of the benchmarks: the model pair to measure, prompts, tables and JSON output."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flax import nnx

import eagle_jax
from eagle_jax.checkpoint.models import resolve_model
from eagle_jax.checkpoint.tokenizer import is_gguf_file
from eagle_jax.config import DrafterConfig, SpecConfig, TargetConfig, default_aux_layer_ids

BUNDLED_TARGET = Path("assets/target")
TARGET_HELP = (
    "target: a checkpoint directory, a .gguf file, or a named model (smollm2-135m-instruct, gemma-3-270m; fetched on "
    "first use)"
)
BUNDLED_DRAFTER = Path("assets/drafter-eagle3.1")


def random_pair(vocab: int = 6144, hidden: int = 384, layers: int = 12, draft_vocab: int = 2048):
    """Untrained models of the bundled pair's shape: right for timing, meaningless for acceptance."""
    tc = TargetConfig(
        architecture="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden // 3 * 2,
        num_layers=layers,
        num_heads=6,
        num_kv_heads=2,
        head_dim=hidden // 6,
        max_position_embeddings=4096,
    )
    target = eagle_jax.Target(tc, rngs=nnx.Rngs(0))
    dc = DrafterConfig(
        hidden_size=hidden,
        num_heads=6,
        num_kv_heads=2,
        head_dim=hidden // 6,
        intermediate_size=tc.intermediate_size,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        target_hidden_size=hidden,
        fc_norm=True,
        norm_output=True,
    )
    drafter = eagle_jax.Drafter(dc, target.embed_tokens[...], rngs=nnx.Rngs(1))
    drafter.set_vocab_map(np.arange(draft_vocab) * (vocab // draft_vocab) - np.arange(draft_vocab))
    return target, drafter


def local_target(target: str | Path | None) -> str | None:
    """A ``--target`` value as a local path: a named model (``smollm2-135m-instruct``) becomes its cached
    .gguf file (fetched on first use); a checkpoint directory or .gguf file stays as it is."""
    return None if target is None else str(resolve_model(str(target)))


def load_pair_or_random(
    target_dir: str | None,
    drafter_dir: str | None,
    prompts_file: str | None,
    prompt_len: int,
    dtype: str = "float32",
    *,
    questions: list[str] | None = None,
    n_questions: int = 0,
    max_new: int = 0,
):
    """(target, drafter, tokenizer or None, prompts as id lists, description of the models and prompts).
    ``target_dir``: a checkpoint directory, a Hub repo id, a .gguf file or a named model.

    Prompts: with ``questions``, ``chat_prompts(questions, tokenizer, n_questions)`` whole (cutting a
    chat prompt would drop its template's start), those too long for ``max_new`` new tokens dropped;
    else ``prompts_file``'s or held-out code prompts, each cut to its last ``prompt_len`` tokens."""
    target_dir = local_target(target_dir) or (str(BUNDLED_TARGET) if BUNDLED_TARGET.exists() else None)
    drafter_dir = drafter_dir or (str(BUNDLED_DRAFTER) if BUNDLED_DRAFTER.exists() else None)
    tokenizer = None
    if target_dir and drafter_dir:
        target = eagle_jax.load_target(target_dir, dtype=dtype)
        drafter = eagle_jax.load_drafter(drafter_dir, target, dtype=dtype)
        source = {"target": target_dir, "drafter": drafter_dir, "dtype": dtype}
        tokenizer = load_tokenizer(target_dir)
    else:
        target, drafter = random_pair()
        source = {"target": "random 12x384", "drafter": "random (acceptance meaningless)"}
    if questions:
        chat = fit_prompts(
            chat_prompts(questions, tokenizer, n_questions), max_new, target.config.max_position_embeddings
        )
        if not chat:
            raise SystemExit(
                f"--questions: no question fits {target.config.max_position_embeddings} positions with {max_new} new "
                "tokens"
            )
        prompts = [p["ids"] for p in chat]
        source["prompts"] = chat_source(questions, n_questions, chat)
    elif prompts_file and tokenizer is not None:
        rows = [json.loads(line) for line in Path(prompts_file).read_text().splitlines() if line.strip()]
        prompts = [tokenizer.encode(r["prompt"], add_special_tokens=False)[-prompt_len:] for r in rows]
        source["prompts"] = {"kind": "file", "file": prompts_file, "prompt_len": prompt_len, "count": len(prompts)}
    elif tokenizer is not None:  # held-out code, the last prompt_len tokens up to a def/class header
        prompts = [p["ids"][-prompt_len:] for p in heldout_code_prompts(tokenizer, 16, min_chars=4 * prompt_len)]
        source["prompts"] = {"kind": "heldout code", "prompt_len": prompt_len, "count": len(prompts)}
    else:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(10, target.config.vocab_size, prompt_len).tolist() for _ in range(16)]
        source["prompts"] = {"kind": "random tokens", "prompt_len": prompt_len, "count": len(prompts)}
    return target, drafter, tokenizer, prompts, source


def load_recipe_pair(recipe: str, prompt_len: int, num_prompts: int = 16):
    """The pair of a tiny training recipe whose target is ``target.random`` (e.g. the DeepSeek-V3-shaped
    configs/train/tiny_mla_moe.yaml): the same seeded target the recipe trained against and the drafter
    it exported to ``<run_dir>/export``; prompts are random tokens from a seed the training data never
    used (its prompts come from seed 0). Returns what ``load_pair_or_random`` returns."""
    from eagle_jax.training.trainer import build_target, load_config

    cfg = load_config(recipe)
    if not cfg["target"]["random"]:
        raise SystemExit(
            f"{recipe}: --recipe takes a recipe with target.random; use --target/--drafter for checkpoints"
        )
    export = Path(cfg["run_dir"]) / "export"
    if not (export / "config.json").exists():
        raise SystemExit(f"{export}: no exported drafter; train it first: eagle-jax-train --config {recipe}")
    target = build_target(cfg)
    drafter = eagle_jax.load_drafter(export, target)
    rng = np.random.default_rng(12345)
    prompts = [rng.integers(0, target.config.vocab_size, prompt_len).tolist() for _ in range(num_prompts)]
    source = {
        "recipe": recipe,
        "target": f"random {target.config.architecture} (seeded)",
        "drafter": str(export),
        "prompts": {"kind": "random tokens", "prompt_len": prompt_len, "count": num_prompts},
    }
    return target, drafter, None, prompts, source


def print_table(header: list[str], rows: list[list]) -> None:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for j, r in enumerate(cells):
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")
        if j == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def write_json(path: str | Path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")
    print(f"wrote {path}")


# ---------------------------------------------------------------------------------------------------
# Shared by bench/acceptance.py, bench/drift.py and bench/peer.py: several drafters over one target,
# held-out code prompts, per-prompt acceptance statistics and plots.

BUNDLED_DRAFTERS = ("assets/drafter-eagle3", "assets/drafter-eagle3.1")
HELDOUT_MANIFEST = Path("assets/data/manifest.json")
EVAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"  # the standard EAGLE question sets
EVAL_SETS = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa")
FALLBACK_TOKENIZER = Path("assets/tokenizer")
RANDOM_WARNING = (
    "WARNING: no trained pair found ({missing}); using RANDOM models of the bundled shape. "
    "Acceptance lengths below are meaningless (about 1.0); only the plumbing is exercised."
)


def drafter_label(drafter) -> str:
    """EAGLE-3.1 when the drafter has any of the 3.1 flags (fc_norm / norm_output), else EAGLE-3."""
    c = drafter.config
    return "EAGLE-3.1" if (c.fc_norm or c.norm_output) else "EAGLE-3"


def random_drafter(target, eagle31: bool, seed: int = 1):
    """An untrained drafter of the bundled shape for ``target`` (EAGLE-3.1 flags on or off)."""
    tc = target.config
    draft_vocab = min(2048, tc.vocab_size)
    dc = DrafterConfig(
        hidden_size=tc.hidden_size,
        num_heads=tc.num_heads,
        num_kv_heads=tc.num_kv_heads,
        head_dim=tc.head_dim,
        intermediate_size=tc.intermediate_size,
        vocab_size=tc.vocab_size,
        draft_vocab_size=draft_vocab,
        target_hidden_size=tc.hidden_size,
        num_aux_hidden_states=len(default_aux_layer_ids(tc.num_layers)),
        fc_norm=eagle31,
        norm_output=eagle31,
    )
    drafter = eagle_jax.Drafter(dc, target.embed_tokens[...], rngs=nnx.Rngs(seed))
    step = tc.vocab_size // draft_vocab
    drafter.set_vocab_map(np.arange(draft_vocab) * step - np.arange(draft_vocab))
    return drafter


def load_tokenizer(path: str | Path | None, vocab_size: int | None = None):
    """``eagle_jax.load_tokenizer(path)`` when ``path`` is a .gguf file (its metadata's tokenizer) or a
    directory with tokenizer files, and (if given) the vocabulary fits ``vocab_size``; else None."""
    if path is None or not (is_gguf_file(path) or (Path(path) / "tokenizer.json").exists()):
        return None
    tok = eagle_jax.load_tokenizer(path)
    if vocab_size is not None and len(tok) > vocab_size:
        print(f"tokenizer at {path} has {len(tok)} tokens > model vocabulary {vocab_size}: not used")
        return None
    return tok


def load_models(target_dir: str | None, drafter_dirs: list[str], dtype: str = "float32", *, need_drafters: bool = True):
    """(target, {name: drafter}, tokenizer or None, description, is_random).

    Loads ``target_dir`` (a checkpoint directory, a .gguf file or a named model) and every drafter
    directory that exists (missing ones are skipped with a message). When the target or all drafters
    are missing, falls back to random models of the bundled shape (one random drafter per requested
    directory, EAGLE-3.1 flags when its name says "3.1") and the bundled tokenizer if present, with a
    loud warning: acceptance is then meaningless.
    """
    target_dir = local_target(target_dir) or str(BUNDLED_TARGET)
    present = [d for d in drafter_dirs if Path(d).exists()]
    for d in drafter_dirs:
        if not Path(d).exists():
            print(f"drafter {d} not found: skipped")
    if Path(target_dir).exists() and (present or not need_drafters):
        target = eagle_jax.load_target(target_dir, dtype=dtype)
        drafters = {}
        for d in present:
            drafter = eagle_jax.load_drafter(d, target, dtype=dtype)
            drafters[f"{Path(d).name} ({drafter_label(drafter)})"] = drafter
        tokenizer = load_tokenizer(target_dir, target.config.vocab_size)
        source = {"target": target_dir, "drafters": present, "dtype": dtype, "random": False}
        return target, drafters, tokenizer, source, False
    missing = target_dir if not Path(target_dir).exists() else ", ".join(drafter_dirs)
    print(RANDOM_WARNING.format(missing=missing))
    target, _ = random_pair()
    drafters = {}
    for i, d in enumerate(drafter_dirs):
        eagle31 = "3.1" in Path(d).name or "31" in Path(d).name
        drafter = random_drafter(target, eagle31, seed=1 + i)
        drafters[f"random {Path(d).name} ({drafter_label(drafter)})"] = drafter
    tokenizer = load_tokenizer(FALLBACK_TOKENIZER, target.config.vocab_size)
    source = {
        "target": "random 12x384",
        "drafters": [f"random ({d})" for d in drafter_dirs],
        "dtype": "float32",
        "random": True,
        "warning": "random weights: acceptance meaningless",
    }
    return target, drafters, tokenizer, source, True


def stop_ids(tokenizer, enabled: bool = True) -> tuple[int, ...]:
    """Tokens that end a row: the tokenizer's eos plus ``<|end_of_text|>`` (the file separator of the
    bundled target's pretraining stream) when the vocabulary has it. Empty when disabled."""
    if not enabled or tokenizer is None:
        return ()
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    sep = tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    if isinstance(sep, int) and sep != tokenizer.unk_token_id and sep >= 0:
        ids.add(sep)
    return tuple(sorted(ids))


def heldout_code_prompts(
    tokenizer,
    n: int,
    *,
    seed: int = 0,
    min_chars: int = 200,
    max_chars: int = 2000,
    vocab_size: int = 0,
    manifest: str | Path = HELDOUT_MANIFEST,
) -> list[dict]:
    """``n`` completion prompts from the held-out split (``code_prompts``), as {"ids", "name", "text"}.

    Without a tokenizer (random fallback only) the prompts are random token ids of similar length.
    """
    if tokenizer is None:
        rng = np.random.default_rng(seed)
        return [
            {
                "ids": rng.integers(10, vocab_size, int(rng.integers(60, 200))).tolist(),
                "name": f"random{i}",
                "text": None,
            }
            for i in range(n)
        ]
    from workshop.corpus import code_prompts, load_corpus

    picked = code_prompts(load_corpus(manifest, "heldout"), n, seed=seed, min_chars=min_chars, max_chars=max_chars)
    if len(picked) < n:
        print(f"only {len(picked)} held-out prompts available (asked for {n})")
    return [
        {
            "ids": tokenizer.encode(p["prompt"], add_special_tokens=False),
            "name": f"{p['name']}:{p['lineno']}",
            "text": p["prompt"],
        }
        for p in picked
    ]


def question_prompts(path: str | Path, tokenizer, limit: int | None = None) -> list[dict]:
    """FastChat question file (``{"question_id", "category", "turns": [...]}`` per line): the first turn
    rendered with the tokenizer's chat template and ``add_generation_prompt=True`` ("ids", "text"; "turn": the
    question itself, for a chat endpoint to render). A base model's tokenizer (no chat template) gets the turn as
    raw text after its special tokens (e.g. ``<bos>``), as its drafter's continuation data is read in training."""
    if tokenizer is None:
        raise SystemExit(f"--questions {path}: needs the target's tokenizer (none loaded)")
    chat = bool(getattr(tokenizer, "chat_template", None))
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        q = json.loads(line)
        turn = q["turns"][0]
        text = (
            tokenizer.apply_chat_template(
                [{"role": "user", "content": turn}], add_generation_prompt=True, tokenize=False
            )
            if chat
            else turn
        )
        out.append(
            {
                "ids": tokenizer.encode(text, add_special_tokens=not chat),
                "name": str(q.get("question_id")),
                "category": q.get("category", "all"),
                "text": text,
                "turn": q["turns"][0],
            }
        )
        if limit and len(out) >= limit:
            break
    return out


def round_robin(sets: list[list], n: int = 0) -> list:
    """The lists' items taken in turn (every list's first item, then every second one, ...), so any
    leading slice mixes the lists; the first ``n`` of them (0: all)."""
    picked = [s[i] for i in range(max(map(len, sets), default=0)) for s in sets if i < len(s)]
    return picked[:n] if n else picked


def question_set_name(path: str | Path) -> str:
    """A question file's set name: its stem, or its folder's name for FastChat's ``<set>/question.jsonl``."""
    p = Path(path)
    return p.parent.name if p.stem == "question" and p.parent.name else p.stem


def chat_prompts(paths: list[str | Path], tokenizer, per_file: int = 0) -> list[dict]:
    """The first ``per_file`` questions (0: all) of each FastChat question file as chat prompts
    (``question_prompts``), the files interleaved round-robin so a truncated list still mixes the sets;
    each dict also has "set" and is named "<set>:<question_id>"."""
    sets = []
    for path in paths:
        name = question_set_name(path)
        sets.append(
            [
                {**q, "set": name, "name": f"{name}:{q['name']}"}
                for q in question_prompts(path, tokenizer, per_file or None)
            ]
        )
    return round_robin(sets)


def chat_source(paths: list[str | Path], per_file: int, prompts: list[dict]) -> dict:
    """The JSON record of a ``chat_prompts`` prompt list (after any ``fit_prompts``)."""
    sets = {question_set_name(p): 0 for p in paths}
    for p in prompts:
        sets[p["set"]] += 1
    return {
        "kind": "questions",
        "files": [str(p) for p in paths],
        "n_questions": per_file,
        "per_set": sets,
        "count": len(prompts),
    }


def fit_prompts(prompts: list[dict], max_new: int, limit: int) -> list[dict]:
    """Drops prompts too long for ``limit`` context positions with ``max_new`` new tokens (says how many)."""
    kept = [p for p in prompts if len(p["ids"]) + max_new <= limit]
    if len(kept) < len(prompts):
        print(f"dropped {len(prompts) - len(kept)} prompts longer than {limit - max_new} tokens")
    return kept


def parse_tree(text: str):
    k, d, n = (int(x) for x in text.split(","))
    return SpecConfig(method="tree", tree_top_k=k, tree_depth=d, tree_total_tokens=n)


def spec_name(spec) -> str:
    if spec is None:
        return "none"
    if spec == "auto":
        return "auto"
    if spec.method == "chain":
        return f"chain K={spec.num_speculative_tokens}"
    return f"tree {spec.tree_top_k}/{spec.tree_depth}/{spec.tree_total_tokens}"


_T95 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def mean_ci95(values) -> tuple[float, float]:
    """(mean, half-width of the 95% Student-t confidence interval of the mean); half-width nan for n < 2."""
    v = np.asarray([x for x in values if x is not None], float)
    if len(v) == 0:
        return float("nan"), float("nan")
    if len(v) < 2:
        return float(v.mean()), float("nan")
    df = len(v) - 1
    t = _T95[df - 1] if df <= len(_T95) else 1.96 + 2.4 / df  # t_0.975 to ~0.01 for df > 30
    return float(v.mean()), float(t * v.std(ddof=1) / np.sqrt(len(v)))


def run_batched(
    target,
    drafter,
    prompts: list[list[int]],
    *,
    spec,
    max_new: int,
    temperature: float = 0.0,
    eos=(),
    seed: int = 0,
    batch_size: int = 0,
) -> dict:
    """``eagle_jax.generate`` over ``prompts`` in calls of ``batch_size`` rows (0: one call); rows are
    independent, so the split changes nothing but memory (and the sampling keys). Returns the merged
    per-row tokens / accepted lists and the summed compile / run seconds."""
    bs = batch_size or len(prompts)
    tokens, accepted, compile_s, run_s = [], [], 0.0, 0.0
    for i in range(0, len(prompts), bs):
        r = eagle_jax.generate(
            target,
            drafter,
            prompts[i : i + bs],
            max_new_tokens=max_new,
            temperature=temperature,
            spec=spec,
            eos_token_id=list(eos),
            seed=seed + i,
        )
        tokens += r.tokens
        accepted += r.accepted
        compile_s += r.compile_s
        run_s += r.run_s
    return {"tokens": tokens, "accepted": accepted, "compile_s": compile_s, "run_s": run_s}


def acceptance_stats(accepted: list[list[int]], max_drafts: int) -> dict:
    """AL statistics from per-row, per-round accepted counts.

    al_mean / al_ci95: mean over prompts of the per-prompt AL (mean of accepted + 1 over that row's
    rounds) and the 95% t-interval half-width; al_pooled: over all rounds of all rows (what
    ``GenerationResult.acceptance_length`` reports); position_acceptance[i]: fraction of rounds whose
    draft i was accepted; conditional[i]: the same given draft i-1 was accepted.
    """
    per_prompt = [float(np.mean(row) + 1) if row else None for row in accepted]
    mean, half = mean_ci95(per_prompt)
    flat = np.asarray([a for row in accepted for a in row], float)
    pos = [float(np.mean(flat > i)) if len(flat) else float("nan") for i in range(max_drafts)]
    cond = [pos[0] if pos else float("nan")] + [
        pos[i] / pos[i - 1] if pos[i - 1] > 0 else float("nan") for i in range(1, len(pos))
    ]
    return {
        "al_mean": mean,
        "al_ci95": half,
        "al_pooled": float(flat.mean() + 1) if len(flat) else float("nan"),
        "position_acceptance": pos,
        "conditional_acceptance": cond,
        "per_prompt_al": per_prompt,
        "rounds": int(len(flat)),
        "prompts": int(sum(p is not None for p in per_prompt)),
    }


def fmt_al(stats: dict) -> str:
    half = stats["al_ci95"]
    return f"{stats['al_mean']:.2f}" + ("" if np.isnan(half) else f" ± {half:.2f}")


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig, ax, path: str | Path) -> None:
    """Grid, legend, tight layout, then ``path`` (its folder made) at 120 dpi; closes the figure."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
