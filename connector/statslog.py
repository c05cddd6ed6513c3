"""Per-transfer JSON lines in ``stats_dir`` (tests and operators read them), one file per
engine and process part (``worker``, ``scheduler``, ``retention``), plus in-memory counts.

Its own module because the scheduler, the retention manager and the worker all write the
same format (it used to live in the worker, which made the scheduler import the worker)."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("kvbaton.connector.stats")


class StatsLog:
    """One writer per file: call :meth:`record` from one thread."""

    def __init__(self, stats_dir: str, engine_id: str, part: str = "worker", *, tp_rank: int | None = None) -> None:
        self.counters: dict[str, int] = {}
        # Every rank's worker appends to the engine's one file (a line per write, O_APPEND);
        # with tensor parallelism each line says which rank wrote it.
        self._fixed: dict[str, Any] = {"tp_rank": tp_rank} if tp_rank is not None else {}
        self._path = Path(stats_dir) / f"{engine_id}.{part}.jsonl" if stats_dir else None
        if self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, event: str, **fields: Any) -> None:
        self.counters[event] = self.counters.get(event, 0) + 1
        if "nbytes" in fields:
            self.counters["bytes"] = self.counters.get("bytes", 0) + int(fields["nbytes"])
        line = {"event": event, "t": time.time(), "pid": os.getpid(), **self._fixed, **fields}
        log.info("kvbaton: %s", json.dumps(line))
        if self._path is not None:
            with open(self._path, "a") as f:
                f.write(json.dumps(line) + "\n")
