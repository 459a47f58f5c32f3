"""The main job: complete a code prompt with the bundled target + EAGLE-3.1 drafter, with and without
speculation, and print the text, the acceptance length and tokens/s of both.

    python -m eagle_jax [--target T --drafter DIR|ORG/NAME] [--prompt TEXT | --chat MESSAGE] [--max-new-tokens N]
                        [--k K | --tree]

(also installed as ``eagle-jax``). T: an HF checkpoint directory or Hub repo id, a .gguf file, or a
named model (``smollm2-135m-instruct``, ``gemma-3-270m``); ``--drafter none`` decodes plainly only.
The bundled pair is found beside the package (``eagle_jax.bundled``), from any working directory. Only
when the bundle is absent and no pair is given does it build a tiny RANDOM Llama in HF format, import it
through the real checkpoint path, check it against transformers, and run the same comparison on it:
that shows the pipeline runs, and its figures mean nothing.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

import eagle_jax
from eagle_jax import bundled
from eagle_jax.config import SpecConfig

RANDOM_NOTE = "random weights, untrained drafter: meaningless"
DEFAULT_PROMPT = '''import re


class Tokenizer:
    """Split a string into tokens."""

    def __init__(self, text):
        self.text = text
        self.pos = 0

    def next(self):
'''


def _tiny_random_pair(workdir: Path):
    """A random tiny Llama saved by transformers, loaded back through eagle_jax's importer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=1024,
    )
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(workdir / "target")
    target = eagle_jax.load_target(workdir / "target")
    ids = torch.randint(0, cfg.vocab_size, (1, 32))
    with torch.no_grad():
        ref = hf(ids).logits.numpy()
    ours = np.asarray(target(ids.numpy())[0])
    err = float(np.abs(ours - ref).max() / np.abs(ref).max())
    print(f"imported a random HF Llama: JAX vs transformers logits, max-abs relative error {err:.2e}")
    dc = eagle_jax.DrafterConfig(
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=256,
        vocab_size=512,
        draft_vocab_size=512,
        target_hidden_size=128,
        fc_norm=True,
        norm_output=True,
    )
    eagle_jax.save_drafter(eagle_jax.Drafter(dc, target.embed_tokens[...]), workdir / "drafter")
    drafter = eagle_jax.load_drafter(workdir / "drafter", target)
    return target, drafter, None, [list(range(1, 17))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--target",
        help="HF target checkpoint directory or Hub repo id, a .gguf file, or a named model "
        "(eagle-jax-fetch --list; default: the bundled target)",
    )
    ap.add_argument(
        "--drafter",
        help="drafter checkpoint directory or Hub repo id (default: the bundled EAGLE-3.1 drafter); "
        "'none': plain decoding only",
    )
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="raw text to continue")
    ap.add_argument(
        "--chat",
        metavar="MESSAGE",
        help="a user message, sent through the target's chat template "
        "(its default system prompt included) instead of --prompt",
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5, help="chain speculation depth")
    ap.add_argument("--tree", action="store_true", help="EAGLE-2 dynamic tree (top_k 8, depth 5, 48 nodes)")
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args(argv)
    if (args.target is None) != (args.drafter is None):
        ap.error("--target and --drafter go together (a drafter is trained for one target); give both or neither")

    tmp = None
    random_model = args.target is None and not bundled.available()
    if random_model:
        print(
            f"WARNING: the bundled models are not installed ({bundled.ASSETS}): running on a tiny RANDOM target with "
            f"an\nuntrained drafter instead. Acceptance length and speedup below mean nothing; they only show the\n"
            f"pipeline runs. Use an editable install of the repository, or pass --target and --drafter."
        )
        tmp = tempfile.TemporaryDirectory()
        target, drafter, tokenizer, prompts = _tiny_random_pair(Path(tmp.name))
    else:
        if args.target is None:
            target_dir, drafter_dir = bundled.target_dir(), bundled.drafter_dir()
            print(f"target:  bundled target {target_dir}\ndrafter: bundled EAGLE-3.1 drafter {drafter_dir}")
        else:
            target_dir, drafter_dir = args.target, args.drafter
            print(f"target:  {args.target}\ndrafter: {args.drafter}")
        target = eagle_jax.load_target(target_dir, dtype="float32")
        drafter = None if drafter_dir == "none" else eagle_jax.load_drafter(drafter_dir, target, dtype="float32")
        tokenizer = eagle_jax.load_tokenizer(target_dir)
        if args.chat is not None:
            if tokenizer.chat_template is None:
                ap.error(f"--chat: the target {target_dir} has no chat template; use --prompt")
            prompts = [
                list(
                    tokenizer.apply_chat_template(
                        [{"role": "user", "content": args.chat}],
                        add_generation_prompt=True,
                        tokenize=True,
                        return_dict=True,
                    )["input_ids"]
                )
            ]
        else:  # the tokenizer's own special tokens: Gemma's <bos>, nothing for SmolLM2
            prompts = [tokenizer.encode(args.prompt)]
    spec = SpecConfig(method="tree") if args.tree else SpecConfig(num_speculative_tokens=args.k)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, tokenizer=tokenizer)
    runs = {}
    for name, d in (("plain", None), ("speculative", drafter)):
        if name == "speculative" and drafter is None:
            continue
        eagle_jax.generate(target, d, prompts, spec=spec, **kw)  # compile once, then measure a warm run
        runs[name] = eagle_jax.generate(target, d, prompts, spec=spec, **kw)
    plain = runs["plain"]
    if drafter is None:
        print("=" * 72 + "\n" + args.prompt + plain.text[0] + "\n" + "=" * 72)
        print(f"plain: {plain.tokens_per_s:8.1f} tokens/s")
        return
    spec_run = runs["speculative"]
    if tokenizer is not None:
        print("=" * 72)
        print((f"user: {args.chat}\nassistant: " if args.chat is not None else args.prompt) + spec_run.text[0])
        print("=" * 72)
    else:
        print("tokens:", spec_run.tokens[0][:32], "...")
    same = "identical" if spec_run.tokens == plain.tokens else "DIFFERENT"
    method = "tree" if args.tree else f"chain K={args.k}"
    note = f"  [{RANDOM_NOTE}]" if random_model else ""
    print(f"speculative ({method}) output vs plain output: {same}")
    print(f"acceptance length: {spec_run.acceptance_length:.2f} tokens per target forward{note}")
    print(f"plain:       {plain.tokens_per_s:8.1f} tokens/s{note}")
    print(
        f"speculative: {spec_run.tokens_per_s:8.1f} tokens/s  ({spec_run.tokens_per_s / plain.tokens_per_s:.2f}x){note}"
    )
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
