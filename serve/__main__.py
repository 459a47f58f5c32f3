"""``python -m serve``: an OpenAI-compatible server over the speculative engine.

    python -m serve                                  # the bundled pair (configs/serve/bundled.yaml)
    python -m serve --target DIR --drafter DIR [--spec '{"method": "eagle3", "num_speculative_tokens": 3}']
                    [--slots 16] [--port 8000] [--max-len N] [--dtype float32|bfloat16]

``--spec`` takes vLLM's speculative config (one depth for every step) or a schedule of chain depths by
number of occupied slots, e.g. ``1:5,4:3,9:0`` (K=5 while 1-3 slots are busy, K=3 from 4, none from 9).
``--drafter none`` serves the target alone.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
PROFILE = REPO / "configs" / "serve" / "bundled.yaml"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=str(PROFILE), help="YAML serving profile; flags override it")
    ap.add_argument("--target")
    ap.add_argument("--drafter", help="drafter directory, or 'none'")
    ap.add_argument("--tokenizer", help="tokenizer directory (default: the target's)")
    ap.add_argument("--spec")
    ap.add_argument("--slots", type=int)
    ap.add_argument("--max-len", type=int)
    ap.add_argument("--rounds-per-step", type=int)
    ap.add_argument("--dtype")
    ap.add_argument("--max-queue", type=int, default=256)
    ap.add_argument("--model-name")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    profile = yaml.safe_load(Path(args.profile).read_text()) if args.profile else {}
    root = Path(args.profile).resolve().parent.parent.parent if args.profile else Path.cwd()
    if args.target:  # a model given on the command line does not inherit the bundled pair's settings
        profile = {k: v for k, v in profile.items() if k in ("slots", "rounds_per_step", "dtype")}

    def pick(flag, key, default=None):
        return flag if flag is not None else profile.get(key, default)

    def path(p):
        if p is None or str(p) == "none":
            return None
        p = Path(p)
        return p if p.is_absolute() or args.target else root / p

    target = path(pick(args.target, "target"))
    if target is None:
        ap.error("no --target and the profile names none")
    drafter = path(pick(args.drafter, "drafter"))

    import uvicorn

    from eagle_jax.config import ConfigError
    from serve.app import create_app
    from serve.server import build_service

    try:
        service = build_service(
            target, drafter, spec=pick(args.spec, "spec"), slots=pick(args.slots, "slots", 16), max_len=pick(args.max_len, "max_len"),
            rounds_per_step=pick(args.rounds_per_step, "rounds_per_step", 4), dtype=pick(args.dtype, "dtype", "float32"),
            max_queue=args.max_queue, model_name=args.model_name, tokenizer_dir=args.tokenizer,
        )
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
    service.scheduler.start()
    try:
        uvicorn.run(create_app(service), host=args.host, port=args.port, log_level="info")
    finally:
        service.scheduler.stop()


if __name__ == "__main__":
    main()
