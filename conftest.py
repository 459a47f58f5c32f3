"""Settings for the whole test suite, applied before JAX is first imported.

The suite is dominated by XLA compiling many small programs on the CPU, not by running them: LLVM's
optimisation level 0 compiles them about 1.8x faster (tests/test_engine.py: 192 s -> 109 s on 2 cores)
and computes the same results (every tolerance in the suite holds). Set EAGLE_JAX_TEST_XLA_OPT=1 to test
with the default optimisation instead. Subprocesses the tests start inherit the setting.
"""

import os

if not os.environ.get("EAGLE_JAX_TEST_XLA_OPT"):
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()

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
