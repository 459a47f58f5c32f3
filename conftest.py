"""Settings for the whole test suite, applied before JAX is first imported.

The suite is dominated by XLA compiling many small programs on the CPU, not by running them, so it
compiles them the cheap way, with the same results (every tolerance in the suite holds):
- LLVM's optimisation level 0: about 1.8x faster compiles (tests/test_engine.py: 192 s -> 109 s on 2 cores);
- the CPU backend's loop emitters instead of its MLIR fusion emitters: half the compile time again
  (backend compile of two serving tests 30.1 s -> 14.9 s; 26 engine and parity tests 195 s -> 149 s of CPU).
Set EAGLE_JAX_TEST_XLA_OPT=1 to test with XLA's defaults instead. Subprocesses the tests start inherit
the setting.
"""

import os
from importlib.metadata import version

FAST_COMPILE_FLAGS = {"--xla_backend_optimization_level": "0"}
# XLA aborts the process on a flag it does not know, and jaxlib 0.11 no longer knows this one.
if tuple(int(p) for p in version("jaxlib").split(".")[:2]) < (0, 11):
    FAST_COMPILE_FLAGS["--xla_cpu_use_fusion_emitters"] = "false"

if not os.environ.get("EAGLE_JAX_TEST_XLA_OPT"):
    flags = os.environ.get("XLA_FLAGS", "")
    extra = [f"{name}={value}" for name, value in FAST_COMPILE_FLAGS.items() if name not in flags]
    os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()

# One persistent compilation cache for the session, shared by the xdist workers and the subprocesses
# tests start (they inherit the environment): tests build many engines with the same programs, and a
# cached program skips XLA's compile (11% off the serving tests). A fresh directory per session, so
# every run measures what a fresh machine pays; JAX_COMPILATION_CACHE_DIR set by the caller wins.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="eagle_jax-test-xla-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
