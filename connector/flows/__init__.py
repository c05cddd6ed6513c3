"""The worker's flows, one module each, all driven by :class:`~kvbaton.connector.loop.TransferLoop`
on the NIXL owner thread (every method here runs on that thread, never blocks, and is
advanced by ``progress``/``step`` calls from the loop):

* :mod:`.sequence` — the one way blocks move between two engines (peer lookup → plan →
  strategy → fingerprints → staged or runs → forget the peer on error), used by every flow;
* :mod:`.send` — prefill: holds blocks for a transfer; push WRITEs on a MATCH;
* :mod:`.receive` — decode's pull READ and push wait, prefill's reuse pin → READ → unpin;
* :mod:`.staged` — the pack path's queue of staged sends and staged READs;
* :mod:`.verify` — ``verify_kv`` fingerprints, owner and reader sides;
* :mod:`.peers` — registrar lookups of peer engines, cached; :mod:`.faults` — test-only faults.
"""
