"""``eagle-jax-serve`` (or ``python -m serve`` in the repository): an OpenAI-compatible server over
the speculative engine.

    eagle-jax-serve                                  # the bundled pair (configs/serve/bundled.yaml)
    eagle-jax-serve --target DIR|ORG/NAME|FILE.gguf|NAME --drafter DIR|ORG/NAME|none
                    [--spec '{"method": "eagle3", "num_speculative_tokens": 3}'] [--slots 16] [--port 8000]
                    [--max-len N] [--dtype float32|bfloat16]
    eagle-jax-serve --target smollm2-135m-instruct --drafter none     # a named model, fetched on first use

``--spec auto`` (the default with a drafter) picks each step's depth from the costs measured at the
number of busy slots and the busy requests' live acceptance (``decoding/chooser.py``). Overrides: vLLM's
speculative config (one depth for every step), or a schedule of chain depths by number of occupied
slots, e.g. ``1:5,4:3,9:0`` (K=5 while 1-3 slots are busy, K=3 from 4, none from 9).

Before it listens, the server compiles every program it may run (``--list-programs`` prints them;
``--no-precompile``: each compiles when first needed, while serving): a prefill chunk of 8, 32, 128 and
``--prefill-chunk`` tokens (every prompt goes through them), the cache row read and copy (prefix reuse,
``n`` choices), a scoring program per length (128, x4, ..., the context), and per speculation depth and
number of computed rows (powers of four up to ``--slots``) a step (a sampling program: greedy rows run on
it exactly). Attention reads only the cache slots a program's rows reach, so no program is compiled per
cache length. Then it runs each once on throwaway rows (scoring programs up to 512 tokens), so that no
program's first run (which links its kernels on the CPU) falls on a request, and logs each program's compile
time and the total. Compiled
programs go to JAX's persistent compilation cache (``--compile-cache``), so a restart loads them.
``--drafter none`` serves the target alone (a profile's speculation schedule is then ignored). Checkpoints are
directories or Hugging Face Hub repo ids; a target may also be a .gguf file or a named model
(``smollm2-135m-instruct``, ``gemma-3-270m``); relative paths in a profile are relative to the profile's folder. The
served model name (``/v1/models``) defaults to the target's directory name, the .gguf file's stem, or the named model's
name.
"""

from __future__ import annotations

import argparse
import logging
import os

BUNDLED_PROFILE = "serve/bundled.yaml"  # under the repository's configs/
API_KEY_ENV = "EAGLE_JAX_API_KEY"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", help="YAML serving profile; flags override it (default: the bundled pair's)")
    ap.add_argument(
        "--target",
        help="HF target checkpoint directory or Hub repo id, a .gguf file, or a named model (eagle-jax-fetch --list)",
    )
    ap.add_argument("--drafter", help="drafter checkpoint directory or Hub repo id, or 'none'")
    ap.add_argument(
        "--tokenizer", help="tokenizer directory, Hub repo id, .gguf file or named model (default: the target's)"
    )
    ap.add_argument(
        "--spec", help="auto (default with a drafter), none, a MIN_ACTIVE:K schedule, or vLLM's JSON speculative config"
    )
    ap.add_argument("--slots", type=int)
    ap.add_argument("--max-len", type=int)
    ap.add_argument(
        "--rounds-per-step", type=int, help="rounds a decode step runs at most, one host round trip each step"
    )
    ap.add_argument(
        "--step-ms",
        type=float,
        default=None,
        help="a step's rounds cut to about this long at the recent time per round: a request arriving "
        "during a step waits for its end (default: 100; 0: always --rounds-per-step)",
    )
    ap.add_argument("--dtype")
    ap.add_argument(
        "--exact",
        action="store_true",
        default=None,
        help="the target computes in float32 whatever --dtype: a request's greedy output then does not "
        "depend on the requests sharing its steps (bf16 otherwise can flip near-ties)",
    )
    ap.add_argument("--max-queue", type=int, default=256)
    ap.add_argument(
        "--precompile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile every program serving may run before listening (one log line each), and run each "
        "once, so that no request waits for a compile or a first run (default: on)",
    )
    ap.add_argument(
        "--compile-workers",
        type=int,
        default=None,
        metavar="N",
        help="programs precompiled at once (default: one per core, at most 8; one on a GPU, where XLA times "
        "candidate kernels on the device while it compiles)",
    )
    ap.add_argument(
        "--compile-cache",
        default=None,
        metavar="DIR|off",
        help="JAX's persistent compilation cache: a restart loads the compiled programs (default: "
        "<cache dir>/xla, the cache dir being $EAGLE_JAX_CACHE, $XDG_CACHE_HOME/eagle_jax or ~/.cache/eagle_jax)",
    )
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="TOKENS",
        help="prompt tokens prefilled between two decode steps at most; longer prompts go in chunks, so "
        "running streams keep going (default: 512; smaller is smoother for running streams, larger "
        "keeps more rows busy)",
    )
    ap.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="automatic prefix caching: a prompt starts from the longest prefix a cache row holds "
        "(another request's, a chat's previous turn) and computes the rest (default: on)",
    )
    ap.add_argument(
        "--prefix-cache-rows",
        type=int,
        default=4,
        metavar="N",
        help="cache rows beside the slots that keep freed slots' prefixes, least recently used out "
        "(memory: N x one slot's caches; default: 4)",
    )
    ap.add_argument(
        "--model-name",
        help="the name /v1/models lists (default: the target's directory name, .gguf stem or model name)",
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        metavar="KEY",
        help=f"every /v1/* route then needs 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; /health and "
        "/metrics stay open)",
    )
    ap.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        metavar="N",
        help="request bodies larger than this are refused with a 400 (default: 8 MiB)",
    )
    ap.add_argument(
        "--list-programs",
        action="store_true",
        help="print the programs the server compiles before it is ready, with their shapes, then exit",
    )
    return ap


def service_settings(args: argparse.Namespace | list[str]) -> dict:
    """``build_service``'s keyword arguments for these flags (parsed, or a command line): the profile
    (default: the bundled pair's) under the flags, and the defaults for what neither gives. A ``--target``
    keeps only the profile's slots, rounds per step, step length, dtype and exact. Benchmarks call it to serve a pair
    as ``eagle-jax-serve`` would."""
    from eagle_jax import ConfigError, bundled
    from eagle_jax.serving.scheduler import STEP_MS
    from eagle_jax.serving.server import read_profile

    if not isinstance(args, argparse.Namespace):
        args = parser().parse_args(args)
    try:
        profile_path = args.profile or bundled.config_path(BUNDLED_PROFILE)
    except bundled.BundleNotFound as exc:
        if args.target is None:
            raise SystemExit(f"error: no --target given, and {exc}") from None
        profile_path = None  # an explicit model needs no profile
    try:
        profile = read_profile(profile_path) if profile_path else {}
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.target:  # a model given on the command line does not inherit the bundled pair's settings
        profile = {k: v for k, v in profile.items() if k in ("slots", "rounds_per_step", "step_ms", "dtype", "exact")}

    def pick(flag, key, default=None):
        return flag if flag is not None else profile.get(key, default)

    def checkpoint(value):
        return None if value is None or str(value) == "none" else str(value)

    target = checkpoint(pick(args.target, "target"))
    if target is None:
        parser().error("no --target and the profile names none")
    drafter = checkpoint(pick(args.drafter, "drafter"))
    spec = pick(args.spec, "spec")
    if drafter is None and args.spec is None and spec is not None and str(spec).strip() != "none":
        # A profile's schedule is for its drafter: serving the target alone decodes plainly.
        logging.getLogger("serve").info("no drafter is served: the profile's speculation schedule %r is ignored", spec)
        spec = None
    return dict(
        target_dir=target,
        drafter_dir=drafter,
        spec=spec,
        slots=pick(args.slots, "slots", 16),
        max_len=pick(args.max_len, "max_len"),
        rounds_per_step=pick(args.rounds_per_step, "rounds_per_step", 4),
        step_ms=float(pick(args.step_ms, "step_ms", STEP_MS)),
        dtype=pick(args.dtype, "dtype", "float32"),
        max_queue=args.max_queue,
        model_name=args.model_name,
        tokenizer_dir=pick(args.tokenizer, "tokenizer"),
        exact=bool(pick(args.exact, "exact", False)),
        precompile=args.precompile,
        compile_workers=args.compile_workers,
        prefix_cache=args.prefix_cache,
        prefix_pool_rows=args.prefix_cache_rows,
        **({} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk}),
    )


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    log = logging.getLogger(__name__)

    from eagle_jax import CheckpointError, ConfigError, compile_cache

    compile_cache.enable(args.compile_cache or compile_cache.default_dir())
    settings = service_settings(args)

    import uvicorn

    from eagle_jax.serving.http_app import MAX_REQUEST_BYTES, create_app
    from eagle_jax.serving.server import build_service, freeze_startup_heap, is_loopback, program_listing

    if args.list_programs:
        settings["precompile"] = False
    try:
        service = build_service(settings.pop("target_dir"), settings.pop("drafter_dir"), **settings)
        app = create_app(service, api_key=args.api_key, max_request_bytes=args.max_request_bytes or MAX_REQUEST_BYTES)
    except (ConfigError, CheckpointError) as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.list_programs:
        print(program_listing(service.scheduler.engine))
        return
    if args.api_key is None and not is_loopback(args.host):
        log.warning(
            "listening on %s without an API key: anyone who can reach it can use it (--api-key or $%s)",
            args.host,
            API_KEY_ENV,
        )
    log.info("start-up heap frozen (a full collection of it took %.2f s)", freeze_startup_heap())
    service.scheduler.start()
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        service.scheduler.stop()


if __name__ == "__main__":
    main()
