"""A JSONL output written shard by shard, so that a long data run (hours of regeneration on a small
machine) survives being stopped and resumes where it stopped.

Records go to ``OUT.partial``, appended and flushed to disk one shard at a time; ``OUT.progress.json``
says, after each shard, how many input records are done, how many output records the partial file
holds, the running totals, and the run's settings (``fingerprint``). A run with the same settings
resumes after the last completed shard: a shard cut off midway (its records appended but the progress
not yet written) is dropped from the partial file and redone, so the result is the same as an
uninterrupted run's. Different settings are refused, naming them, rather than mixed into one file.
When the run ends, the partial file is renamed to OUT and the progress file removed; a later run with OUT already
there is refused unless it restarts, so a finished output is never overwritten by accident.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from eagle_jax.training.chat import DataError


class ShardedOutput:
    def __init__(self, out: str | os.PathLike, fingerprint: dict[str, Any], *, restart: bool = False):
        self.out = Path(out)
        self.partial = self.out.with_name(self.out.name + ".partial")
        self.progress_file = self.out.with_name(self.out.name + ".progress.json")
        self.fingerprint = json.loads(json.dumps(fingerprint))  # as it reads back from JSON
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.inputs_done, self.written, self.shards, self.totals = 0, 0, 0, {}
        if restart:
            self.partial.unlink(missing_ok=True)
            self.progress_file.unlink(missing_ok=True)
        elif self.progress_file.exists():
            self._resume()
        elif self.out.exists():  # a finished run's output: writing it again is asked for, never assumed
            raise DataError(
                f"{self.out} exists (a finished run): pass --restart to write it again, or choose another --out"
            )
        else:
            self.partial.unlink(missing_ok=True)  # records of a shard that never completed

    def _resume(self) -> None:
        try:
            state = json.loads(self.progress_file.read_text())
            settings = state["fingerprint"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DataError(
                f"{self.progress_file}: not a valid progress file ({e}); delete it, or pass --restart"
            ) from e
        changed = sorted(k for k in set(settings) | set(self.fingerprint) if settings.get(k) != self.fingerprint.get(k))
        if changed:
            was = ", ".join(f"{k}={settings.get(k)!r} (now {self.fingerprint.get(k)!r})" for k in changed)
            raise DataError(
                f"{self.progress_file}: an unfinished run with other settings writes {self.out}: {was}; "
                f"rerun with its settings to resume it, pass --restart to discard it, or choose another --out"
            )
        self.inputs_done, self.written = int(state["inputs_done"]), int(state["written"])
        self.shards, self.totals = int(state["shards"]), dict(state["totals"])
        lines = self.partial.read_text(encoding="utf-8").splitlines(keepends=True) if self.partial.exists() else []
        if len(lines) < self.written:
            raise DataError(
                f"{self.partial}: holds {len(lines)} records, its progress file says {self.written}; pass --restart"
            )
        if len(lines) > self.written:  # a shard cut off after appending: redone
            with open(self.partial, "w", encoding="utf-8") as f:
                f.writelines(lines[: self.written])

    @property
    def resumed(self) -> bool:
        return self.shards > 0

    def records(self) -> list[dict]:
        """The output records written so far."""
        if not self.partial.exists():
            return []
        return [json.loads(line) for line in self.partial.read_text(encoding="utf-8").splitlines() if line.strip()]

    def append(self, records: list[dict], inputs: int, counts: dict[str, int]) -> None:
        """One completed shard: its output records, the input records it consumed, its counters."""
        with open(self.partial, "a", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.inputs_done += inputs
        self.written += len(records)
        self.shards += 1
        for k, v in counts.items():
            self.totals[k] = self.totals.get(k, 0) + int(v)
        state = {
            "fingerprint": self.fingerprint,
            "inputs_done": self.inputs_done,
            "written": self.written,
            "shards": self.shards,
            "totals": self.totals,
        }
        tmp = self.progress_file.with_name(self.progress_file.name + ".tmp")
        tmp.write_text(json.dumps(state, indent=1) + "\n")
        os.replace(tmp, self.progress_file)

    def finish(self) -> None:
        """The partial file becomes the output (nothing is renamed when no record was written)."""
        if self.written:
            os.replace(self.partial, self.out)
        else:
            self.partial.unlink(missing_ok=True)
        self.progress_file.unlink(missing_ok=True)


__all__ = ["ShardedOutput"]
