"""The router ⇄ connector contract: the keys of vLLM's ``kv_transfer_params``.

The router writes them into the request bodies it sends to the prefill and decode engines;
the connector's scheduler reads them, and prefill's response carries the pull hand-off back
through the router to decode. Both sides import the names from here (the router never
imports the connector), so a renamed or misspelt key is an import error, not a silently
ignored field. Plain dicts stay on the wire (vLLM passes ``kv_transfer_params`` through
as JSON); this module only names and builds them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# ---- the contract's version (every builder below writes it; both sides check it)
VERSION = "kvbaton_params_version"
PARAMS_VERSION = 1  # bump on any change a peer built against the old keys would misread
# ---- request routing (router → both engines)
DO_REMOTE_DECODE = "do_remote_decode"  # prefill: hold the blocks for a remote decode
DO_REMOTE_PREFILL = "do_remote_prefill"  # decode: the prompt's KV comes from a prefill engine
TRANSFER_ID = "transfer_id"  # fresh per dispatch; names the rendezvous transfer
TRANSFER_MODE = "transfer_mode"  # "push" | "pull"; overrides the engine's default mode
CONVERSATION_ID = "conversation_id"  # decode: retain this turn's blocks for the next one
REUSE = "reuse"  # prefill: where the conversation's retained KV lies (a :class:`ReuseOffer`)
TRACEPARENT = "traceparent"  # W3C trace context, forwarded on the connector's gRPC calls
# Push binding (README "Security"): the router names the pair; prefill's Complete names the
# decode, decode's Offer names the prefill, and the control plane matches only that pair.
DECODE_ENGINE_ID = "decode_engine_id"  # prefill: the decode engine that may offer
PREFILL_ENGINE_ID = "prefill_engine_id"  # decode: the prefill engine that may complete
# ---- pull hand-off (prefill's response → decode's request)
REMOTE_ENGINE_ID = "remote_engine_id"
REMOTE_BLOCK_IDS = "remote_block_ids"
REMOTE_NUM_TOKENS = "remote_num_tokens"
# ---- decode's response
RETAINED = "retained"  # what decode kept for the conversation (retention record)


def version_error(p: Any) -> str:
    """Why ``p`` (a ``kv_transfer_params`` dict) is refused, or "" when its version is ours.

    A dict without the key predates versioning (version 1, same keys) and is accepted, so
    hand-written params and older routers keep working; any other version is refused by
    name, because a peer on another contract could misread every other key."""
    if not isinstance(p, dict) or VERSION not in p:
        return ""
    v = p[VERSION]
    if isinstance(v, int) and not isinstance(v, bool) and v == PARAMS_VERSION:
        return ""
    return (f"kv_transfer_params version {v!r} is not supported: this kvbaton speaks version "
            f"{PARAMS_VERSION} (upgrade the router and the engines' connectors together)")


@dataclasses.dataclass(frozen=True)
class ReuseOffer:
    """``kv_transfer_params["reuse"]``: the router's lookup of a conversation's retained KV
    on a decode engine, under a live lease. Prefill pins ``lease_id`` and checks that it
    still protects ``retention_id`` before it READs ``block_ids``."""

    conversation_id: str
    engine_id: str
    lease_id: str
    retention_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    tokens_per_block: int
    block_hashes: tuple[bytes, ...]

    def to_params(self) -> dict[str, Any]:
        return {"conversation_id": self.conversation_id, "engine_id": self.engine_id,
                "lease_id": self.lease_id, "retention_id": self.retention_id, "block_ids": list(self.block_ids),
                "num_tokens": self.num_tokens, "tokens_per_block": self.tokens_per_block,
                "block_hashes": [h.hex() for h in self.block_hashes]}

    @classmethod
    def from_params(cls, d: Any) -> ReuseOffer | None:
        """The offer, or None when anything is missing or malformed (then: recompute)."""
        if not isinstance(d, dict):
            return None
        try:
            offer = cls(str(d.get("conversation_id") or ""), str(d.get("engine_id") or ""),
                        str(d.get("lease_id") or ""), str(d.get("retention_id") or ""),
                        tuple(int(b) for b in d.get("block_ids") or ()), int(d.get("num_tokens") or 0),
                        int(d.get("tokens_per_block") or 0),
                        tuple(bytes.fromhex(h) for h in d.get("block_hashes") or ()))
        except (TypeError, ValueError):
            return None
        if not (offer.conversation_id and offer.engine_id and offer.lease_id and offer.retention_id):
            return None
        return offer


def prefill_request(transfer_id: str, *, mode: str = "", reuse: ReuseOffer | dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    """Router → prefill: compute the prompt and hold its blocks for ``transfer_id``."""
    p: dict[str, Any] = {VERSION: PARAMS_VERSION, DO_REMOTE_DECODE: True, DO_REMOTE_PREFILL: False,
                         TRANSFER_ID: transfer_id}
    if mode:
        p[TRANSFER_MODE] = mode
    if reuse:
        p[REUSE] = reuse.to_params() if isinstance(reuse, ReuseOffer) else reuse
    return p


def decode_push_request(transfer_id: str) -> dict[str, Any]:
    """Router → decode (push): offer blocks for ``transfer_id``; prefill WRITEs into them."""
    return {VERSION: PARAMS_VERSION, DO_REMOTE_PREFILL: True, DO_REMOTE_DECODE: False, TRANSFER_ID: transfer_id,
            TRANSFER_MODE: "push"}


def pull_handoff(engine_id: str, block_ids: list[int], num_tokens: int, transfer_id: str) -> dict[str, Any]:
    """Prefill's response (pull) → decode's request: READ these held blocks."""
    return {VERSION: PARAMS_VERSION, DO_REMOTE_PREFILL: True, DO_REMOTE_DECODE: False, REMOTE_ENGINE_ID: engine_id,
            REMOTE_BLOCK_IDS: [int(b) for b in block_ids], REMOTE_NUM_TOKENS: int(num_tokens),
            TRANSFER_ID: transfer_id, TRANSFER_MODE: "pull"}


def push_handoff(engine_id: str, transfer_id: str) -> dict[str, Any]:
    """Prefill's response (push): the WRITE is on its way; nothing for decode to read."""
    return {VERSION: PARAMS_VERSION, TRANSFER_ID: transfer_id, TRANSFER_MODE: "push", REMOTE_ENGINE_ID: engine_id}
