"""Building the served model (target, drafter, tokenizer, engine, scheduler), serving profiles, and
running uvicorn. Needs the ``serve`` extra (FastAPI, uvicorn, prometheus-client)."""

from __future__ import annotations

import gc
import json
import logging
import os
import threading
import time
from pathlib import Path

from eagle_jax.checkpoint.hub import looks_like_repo_id
from eagle_jax.checkpoint.tokenizer import is_gguf_file
from eagle_jax.config import ConfigError, SpecConfig
from eagle_jax.decoding.calls import eos_ids
from eagle_jax.decoding.chooser import Chooser
from eagle_jax.serving import Scheduler, SlotEngine, SpecSchedule
from eagle_jax.serving.http_app import Service, create_app
from eagle_jax.serving.metrics import Metrics
from eagle_jax.serving.program_cache import describe
from eagle_jax.serving.scheduler import STEP_MS
from eagle_jax.serving.slots import DEFAULT_CHUNK, default_compile_workers

log = logging.getLogger("serve")

PROFILE_PATH_KEYS = ("target", "drafter", "tokenizer")


def read_profile(path: str | Path) -> dict:
    """A YAML serving profile (keys: target, drafter, tokenizer, spec, slots, max_len, rounds_per_step,
    step_ms, dtype, exact). Relative checkpoint paths (directories, .gguf files) in it are relative to the profile's
    own folder, so it works from any working directory; a value that names no such path but reads as a Hub
    repo id (or a named model such as ``smollm2-135m-instruct``) stays as it is."""
    import yaml

    path = Path(path)
    try:
        profile = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read the serving profile ({exc})") from None
    if not isinstance(profile, dict):
        raise ConfigError(f"{path}: a serving profile is a YAML mapping, not {type(profile).__name__}")
    for key in PROFILE_PATH_KEYS:
        value = profile.get(key)
        if value is None or str(value) == "none":
            continue
        local = (path.resolve().parent / str(value)).resolve()
        if local.exists() or not looks_like_repo_id(str(value)):
            profile[key] = str(local)
    return profile


def parse_spec(text: str | None, drafter_present: bool) -> SpecSchedule | Chooser:
    """``--spec``: ``auto`` (the default with a drafter: ``decoding.chooser.Chooser``), a JSON object (vLLM's
    speculative config, one depth), a MIN_ACTIVE:K schedule, or ``none``."""
    text = (text or "").strip()
    if not drafter_present:
        if text not in ("", "none"):
            raise ConfigError(
                f"--spec {text!r} was given but no drafter is served (--drafter none): leave --spec out or give --spec "
                "none"
            )
        return SpecSchedule.fixed(None)
    if text == "none":
        return SpecSchedule.fixed(None)
    if text in ("", "auto"):
        return Chooser()
    if not text.startswith("{"):
        return SpecSchedule.parse(text)
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--spec is not valid JSON: {exc}") from None
    if isinstance(spec, dict):
        spec.pop("model", None)  # vLLM names the drafter here; ours comes from --drafter
    return SpecSchedule.fixed(SpecConfig.parse(spec))


def build_service(
    target_dir: str | Path,
    drafter_dir: str | Path | None,
    *,
    spec: str | None = None,
    slots: int = 16,
    max_len: int | None = None,
    rounds_per_step: int = 4,
    dtype: str | None = "float32",
    max_queue: int = 256,
    model_name: str | None = None,
    tokenizer_dir: str | Path | None = None,
    precompile: bool = True,
    compile_workers: int | None = None,
    exact: bool = False,
    prefill_chunk: int = DEFAULT_CHUNK,
    prefix_cache: bool = True,
    prefix_pool_rows: int = 4,
    step_ms: float = STEP_MS,
) -> Service:
    """Loads the models and the tokenizer and wires them into a ``Service``.

    ``target_dir``: whatever ``eagle_jax.load_target`` takes (a checkpoint directory, a Hub repo id, a
    .gguf file or a named model); ``drafter_dir``: a drafter checkpoint directory or Hub repo id, or None
    to serve the target alone; ``tokenizer_dir``: whatever ``eagle_jax.load_tokenizer`` takes (default:
    the target's). ``model_name`` defaults to ``served_name(target_dir)``."""
    import eagle_jax

    target = eagle_jax.load_target(target_dir, dtype=dtype)
    drafter = None if drafter_dir is None else eagle_jax.load_drafter(drafter_dir, target, dtype=dtype)
    tokenizer = eagle_jax.load_tokenizer(tokenizer_dir or target_dir)
    log.info("loaded %s with %s", target_dir, drafter_dir or "no drafter")
    return make_service(
        target,
        drafter,
        tokenizer,
        parse_spec(spec, drafter is not None),
        eos_ids(target, tokenizer),
        slots=slots,
        max_len=max_len,
        rounds_per_step=rounds_per_step,
        max_queue=max_queue,
        model_name=model_name or served_name(target_dir),
        precompile=precompile,
        compile_workers=compile_workers,
        exact=exact,
        prefill_chunk=prefill_chunk,
        prefix_cache=prefix_cache,
        prefix_pool_rows=prefix_pool_rows,
        step_ms=step_ms,
    )


def served_name(target: str | Path) -> str:
    """The model name a target is served under by default: a .gguf file's stem, else the last part of the
    path (a directory's name, a Hub repo id's name, a named model's name)."""
    path = Path(target)
    if path.exists():
        path = Path(os.path.abspath(path))  # "." names its folder; symlinks are not followed
    return path.stem if is_gguf_file(path) else path.name


def make_service(
    target,
    drafter,
    tokenizer,
    schedule: SpecSchedule | Chooser,
    eos_ids: tuple[int, ...],
    *,
    slots: int = 16,
    max_len: int | None = None,
    rounds_per_step: int = 4,
    max_queue: int = 256,
    model_name: str = "model",
    precompile: bool = True,
    compile_workers: int | None = None,
    exact: bool = False,
    prefill_chunk: int = DEFAULT_CHUNK,
    prefix_cache: bool = True,
    prefix_pool_rows: int = 4,
    step_ms: float = STEP_MS,
) -> Service:
    """A ``Service`` over models already loaded (benchmarks build several over one pair). ``precompile``:
    compile every program serving may run first (``SlotEngine.precompile``, ``compile_workers`` at once, default
    ``default_compile_workers()``; else each compiles when first needed, while serving). ``exact``: the target
    computes in float32 whatever its weights' dtype (``generate``'s exact mode). ``prefill_chunk``: the prompt tokens
    prefilled between two steps at most (longer prompts go in chunks); ``prefix_cache``: prompts start from the longest
    prefix a cache row holds, with ``prefix_pool_rows`` rows beside the slots keeping what freed slots held.
    ``step_ms``: a step's rounds are cut to about this long (``Scheduler``; 0: always ``rounds_per_step``)."""
    holder: dict = {}

    def on_compile(key: tuple, seconds: float) -> None:
        log.info("compiled %s (%s) in %.1f s", describe(key), holder["engine"].program_shapes(key), seconds)
        if "metrics" in holder:
            holder["metrics"].on_compile(key, seconds)

    engine = SlotEngine(
        target,
        drafter,
        slots=slots,
        max_len=max_len,
        specs=schedule.specs,
        rounds_per_step=rounds_per_step,
        eos_ids=eos_ids,
        exact=exact,
        on_compile=on_compile,
        chunk=prefill_chunk,
        prefix_cache=prefix_cache,
        pool_rows=prefix_pool_rows if prefix_cache else 0,
    )
    holder["engine"] = engine
    scheduler = Scheduler(engine, schedule, max_queue=max_queue, step_ms=step_ms)
    metrics = holder["metrics"] = Metrics(scheduler)
    scheduler.on_step = metrics.on_step
    log.info(
        "%d slots of %d tokens; speculation %s; prompts prefilled %d tokens per step at most",
        slots,
        engine.max_len,
        schedule.describe(),
        engine.chunk,
    )
    if prefix_cache:
        log.info(
            "prefix caching: the slots and %d pool rows (%.1f MiB each)", engine.pool_rows, engine.row_bytes / 2**20
        )
    if precompile:
        t0 = time.perf_counter()
        workers = default_compile_workers() if compile_workers is None else compile_workers
        engine.precompile(workers=workers)
        log.info(
            "%d programs ready and run once in %.1f s (%.1f s of compiles or loads from the compilation cache, %d at a "
            "time)",
            len(engine.program_set()),
            time.perf_counter() - t0,
            sum(s for _, s in engine.compile_events),
            workers,
        )
    return Service(scheduler, tokenizer, model_name, metrics)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback interface only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def program_listing(engine: SlotEngine) -> str:
    """The engine's precompiled program set, one line per program with its shapes (``--list-programs``)."""
    keys = engine.program_set()
    lines = [
        f"{len(keys)} programs ({engine.slots} slots x {engine.max_len} tokens, {engine.pool_rows} prefix-cache pool "
        "rows):"
    ]
    lines += [f"  {describe(key)}: {engine.program_shapes(key)}" for key in keys]
    return "\n".join(lines)


def freeze_startup_heap() -> float:
    """Collects the garbage of start-up, then moves what lives on (the models, the compiled programs, JAX's
    own state) out of the cyclic collector's reach (``gc.freeze``); returns the seconds a full collection took
    before. Otherwise every full collection while serving walks that whole heap, a stall of every stream it
    strikes (~0.25-0.45 s for the bundled pair on a CPU, about once in ten ``generate`` calls' worth of
    allocation); frozen, it walks only what requests allocated. A long-lived server's choice, not a library's:
    objects frozen stay out of collection (``gc.unfreeze`` gives them back, e.g. before dropping a service)."""
    t0 = time.perf_counter()
    gc.collect()
    seconds = time.perf_counter() - t0
    gc.freeze()
    return seconds


class Server:
    """uvicorn in a background thread (tests, benchmarks); ``eagle-jax-serve`` runs it in the foreground."""

    def __init__(self, service: Service, host: str = "127.0.0.1", port: int = 0, **app_options):
        import uvicorn

        self.service = service
        config = uvicorn.Config(
            create_app(service, **app_options), host=host, port=port, log_level="warning", lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Server":
        self.service.scheduler.start()
        self._thread = threading.Thread(target=self._server.run, name="uvicorn", daemon=True)
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the HTTP server failed to start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join()
        self.service.scheduler.stop()
