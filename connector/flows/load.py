"""One load's state (a READ into our blocks, or a push we wait for), shared by the receive
flow, its verification and its stats (a module of its own so none of them imports another
in a circle)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

from ..metadata import LoadSpec
from ..transfer.integrity import Fingerprints
from .sequence import Move


@dataclasses.dataclass
class Load:
    req_id: str
    spec: LoadSpec
    deadline: float
    t0: float
    move: Move | None = None
    peer_future: concurrent.futures.Future[Any] | None = None  # release only: the lookup
    nbytes: int = 0  # push: what the writer says it wrote
    strategy: str = "runs"
    # reuse
    pin_future: concurrent.futures.Future[Any] | None = None
    pin_id: str = ""
    pin_expires_at_ms: int = 0  # the service's clock: when our pin lapses unless unpinned
    pin_sent: float = 0.0
    read_deadline: float = 0.0
    delay_until: float = 0.0  # test-only fault: reuse READ held back until then
    fault_killed_group: int = 0  # test-only fault: the owner group killed, READ held until it is gone
    # the ledger (pull and reuse): BeginRead before the READ, ReportOutcome after it
    begin_future: concurrent.futures.Future[Any] | None = None
    begin_after: float = 0.0  # BeginRead again no sooner (our registration lapsed: flows/receive.py)
    begun: bool = False  # BeginRead answered (or the server has no ledger): READ may be posted
    # where the load's time went (monotonic; 0 = not reached): the stats line's *_s fields
    t_pinned: float = 0.0
    t_begun: float = 0.0
    ledger_attempt: int | None = None  # the ledger's transfer attempt; None: nothing to report
    # verify_kv
    landed: bool = False  # the data is in our blocks; verification (if on) still to do
    t_landed: float = 0.0
    fp_key: str = ""  # pull/reuse: the key of the owner's answer we wait for
    fp_owner: Fingerprints | None = None
    fp_local: concurrent.futures.Future[Any] | None = None
    corrupted: bool = False

    @property
    def peer(self) -> str:
        return self.move.peer if self.move is not None else ""
