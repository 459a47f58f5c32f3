"""Fetch a named model into the local cache, once; later uses need no network.

Usage: ``eagle-jax-fetch NAME [--dir D]`` (``smollm2-135m-instruct``, ``gemma-3-270m``) or ``eagle-jax-fetch --list``

Prints the model file's path as the last line of stdout (pip's progress and notes go to stderr), so
``MODEL=$(eagle-jax-fetch NAME | tail -1)`` works in scripts. The path is then what every command's
``--target`` takes, as is the name itself. Default location: ``$EAGLE_JAX_CACHE``, else
``$XDG_CACHE_HOME/eagle_jax``, else ``~/.cache/eagle_jax`` (``eagle_jax.checkpoint.models``).
"""

from __future__ import annotations

import argparse
import sys

from eagle_jax.checkpoint import models
from eagle_jax.checkpoint.tensor_files import CheckpointError


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name", nargs="?", help="a known model name (--list shows them)")
    p.add_argument("--dir", help="directory to put the file in (default: the cache's models/<name>/)")
    p.add_argument("--list", action="store_true", help="list the known names and exit")
    p.add_argument("--quiet", action="store_true", help="no download progress on stderr")
    args = p.parse_args(argv)
    if args.list:
        for m in models.MODELS.values():
            cached = " (cached)" if models.model_path(m.name).exists() else ""
            print(f"{m.name}\t{m.size / 2**20:.0f} MiB\t{m.description}{cached}")
        return
    if args.name is None:
        p.error("give a model name, or --list")
    if args.name not in models.MODELS:
        print(f"error: unknown model name '{args.name}'; known: {', '.join(sorted(models.MODELS))}", file=sys.stderr)
        raise SystemExit(2)
    try:
        path = models.fetch_model(args.name, args.dir, quiet=args.quiet)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    print(path)


if __name__ == "__main__":
    main()
