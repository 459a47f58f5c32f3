"""Train an EAGLE-3 / 3.1 drafter with training-time test (TTT) against a frozen target.

Usage: ``eagle-jax-train --config configs/train/<recipe>.yaml [--set key.sub=value ...]``

A relative ``--config`` that is not found from the working directory is looked up in the repository
(so ``configs/train/tiny.yaml`` works from anywhere); paths inside a recipe (``run_dir``, the target,
the data) stay relative to the working directory, where runs and user data live.

``target.path`` takes an HF checkpoint directory or Hub repo id, a .gguf file, or a named model
(``smollm2-135m-instruct``, fetched into the cache on first use); ``data.tokenizer`` the same (default:
the target's).

Resumes from ``<run_dir>/checkpoints`` when it holds a checkpoint; writes ``<run_dir>/log.jsonl`` and,
at the end, the drafter in the EAGLE PyTorch layout to ``export.dir`` (default ``<run_dir>/export``).
Multi-host: set ``distributed.coordinator`` (host:port), ``distributed.num_processes`` and
``distributed.process_id`` on every process (or run under a launcher JAX auto-detects).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eagle_jax import bundled
from eagle_jax.training.trainer import load_config, train


def recipe_path(text: str) -> str:
    """``text`` as given when it exists or is absolute, else the same relative path in the repository."""
    path = Path(text).expanduser()
    if path.exists() or path.is_absolute() or not (bundled.REPO / path).is_file():
        return str(path)  # load_config reports a missing file with its own message
    return str(bundled.REPO / path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML recipe (configs/train/*.yaml)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.steps=100 (value parsed as YAML)",
    )
    p.add_argument(
        "--stop-after", type=int, help="stop after this step (checkpointed), as if killed; for testing resume"
    )
    args = p.parse_args(argv)
    cfg = load_config(recipe_path(args.config), args.overrides)
    summary = train(cfg, stop_after=args.stop_after)
    if summary["records"]:
        last = summary["records"][-1]
        print(
            f"step {summary['step']}: loss {last['loss']:.4f}, step-0 accuracy {last['acc_per_position'][0]:.3f}, "
            f"simulated AL {last['simulated_al']:.2f}"
        )


if __name__ == "__main__":
    main()
