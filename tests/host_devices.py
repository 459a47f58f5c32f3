"""The environment of a subprocess that sees ``n`` host CPU devices.

XLA reads XLA_FLAGS once, when jax is imported, so a test needing several devices starts a
subprocess. It keeps the suite's other XLA flags (conftest.py's fast-compile setting) and replaces
only the device count.
"""

from __future__ import annotations

import os

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def env_with_devices(n: int, *pythonpath: str) -> dict[str, str]:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    env["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_COUNT_FLAG}={n}"])
    env["JAX_PLATFORMS"] = "cpu"
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (*pythonpath, env.get("PYTHONPATH")) if p)
    return env
