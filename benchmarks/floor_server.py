"""``kvbaton serve`` with the rendezvous domain replaced by canned answers: the floor.

Why: ``benchmarks/control_plane.py --floor`` runs its session-answer points against this
server too, in the same run as the real one. Everything a match costs the real server
except the rendezvous work itself is still here: gRPC, the event loop, the Session
handler, the guard, the load monitor, a registered engine's Subscribe stream. So the
real server's CPU per match minus this one's is what kvbaton's own rendezvous code
costs, and this one's is what no change to that code can remove.

An offer is answered OFFERED; a completion is answered as the MATCH (``match_delivered``)
at once, so the load generator's session-answer path sees every transfer matched. Not a
control plane: nothing is recorded, checked or sent on any stream. Only for benchmarks.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def install() -> None:
    from kvbaton.services.api import rendezvous
    from kvbaton.v1 import rendezvous_pb2 as pb

    async def offer(self, r: pb.OfferRequest, out: pb.RendezvousResponse | None = None) -> pb.RendezvousResponse:
        out = pb.RendezvousResponse() if out is None else out
        out.state.transfer_id, out.state.phase = r.transfer_id, pb.TRANSFER_PHASE_OFFERED
        return out

    async def complete(self, r: pb.CompleteRequest, out: pb.RendezvousResponse | None = None) -> pb.RendezvousResponse:
        out = pb.RendezvousResponse() if out is None else out
        t = out.state
        t.transfer_id, t.phase, t.match_answered = r.transfer_id, pb.TRANSFER_PHASE_MATCHED, True
        t.completion.engine_id = r.prefill_engine_id
        out.matched_now, out.match_delivered = True, r.match_in_answer
        return out

    rendezvous.RendezvousServicer._offer = offer  # type: ignore[method-assign]
    rendezvous.RendezvousServicer._complete = complete  # type: ignore[method-assign]


if __name__ == "__main__":
    install()
    from kvbaton.cli import main

    sys.exit(main())
