"""``kvbaton serve`` with the rendezvous domain replaced by canned answers: the floor.

Why: ``benchmarks/control_plane.py --floor`` runs its session-answer points against this
server too, in the same run as the real one. Everything a match costs the real server
except the rendezvous work itself is still here: gRPC, the event loop, the Session
handler, the guard, the load monitor, a registered engine's Subscribe stream. So the
real server's CPU per match minus this one's is what kvbaton's own rendezvous code
costs, and this one's is what no change to that code can remove.

An offer is answered OFFERED; a completion is answered as the MATCH (``match_delivered``)
at once, so the load generator's session-answer path sees every transfer matched. A
completion with several writers (``control_plane.py --tp N``: the answer can only be one
rank's MATCH) is answered MATCHED and its MATCH offered to every Subscribe stream of the
prefill engine, as the real hub does. Not a control plane: nothing is recorded or checked.
Only for benchmarks.
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

    revision = [1 << 40]  # above any revision the store has: resuming subscribers skip nothing

    async def complete(self, r: pb.CompleteRequest, out: pb.RendezvousResponse | None = None) -> pb.RendezvousResponse:
        out = pb.RendezvousResponse() if out is None else out
        t = out.state
        t.transfer_id, t.phase = r.transfer_id, pb.TRANSFER_PHASE_MATCHED
        t.completion.engine_id = r.prefill_engine_id
        if r.writers <= 1:
            t.match_answered = True
            out.matched_now, out.match_delivered = True, r.match_in_answer
            return out
        out.matched_now = True
        revision[0] += 1
        t.revision = revision[0]
        event = pb.RendezvousEvent(type=pb.RendezvousEvent.TYPE_MATCH, transfer=t, revision=revision[0])
        size = event.ByteSize()
        for sub in self.domain.hub._subs.get(r.prefill_engine_id, ()):  # what the hub derives to
            sub.offer(revision[0], event, size)
        return out

    rendezvous.RendezvousServicer._offer = offer  # type: ignore[method-assign]
    rendezvous.RendezvousServicer._complete = complete  # type: ignore[method-assign]


if __name__ == "__main__":
    install()
    from kvbaton.cli import main

    sys.exit(main())
