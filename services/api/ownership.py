"""Ownership checks that need the records, for callers with an engine token.

``services/auth.py`` decides from the request alone (an engine token acts only under
its own engine ids). These checks read what the request would change and refuse
(PERMISSION_DENIED, with the reason) when it belongs to another engine:

- ``Lease.Revoke``: the lease must be on one of the caller's engines;
- ``Lease.Grant`` / ``Registrar.RegisterRetained``: a conversation whose live lease is
  on another engine cannot be taken over (that would point the router's reuse at the
  caller's blocks: KV injection); it can once that lease ends (expired, revoked by its
  engine, an agent or an operator), or once that engine is gone from the registrar
  (deregistered, or its liveness TTL lapsed: a dead engine's blocks died with it, while
  its lease may live on, renewed by the conversation's agent, and would otherwise keep
  every other decode from retaining the conversation's next turns; the registrar's
  records are read from the shared store, whichever process serves the registrar);
- ``Registrar.ReleaseRetained``: the registration must be on one of the caller's engines.

Operators, routers and agents are not engines: their scopes are the rules' business.
Without tokens (``CALLER`` unset, or not an engine) nothing here applies.
"""

from __future__ import annotations

from kvbaton.v1 import lease_pb2

from ..auth import Principal
from ..domain.errors import DomainError, denied
from ..domain.lease import LIVE_STATES, LeaseService
from ..domain.registrar import RegistrarService
from .guard import CALLER


def engine_caller() -> Principal | None:
    """The caller if it holds an engine token, else None (nothing to check)."""
    p = CALLER.get()
    return p if p is not None and p.role == "engine" else None


def owner_identity() -> str:
    """The identity that owns what this caller registers: a token's or a client
    certificate's; "" (no ownership recorded or checked) for an unauthenticated peer."""
    p = CALLER.get()
    if p is None or not p.identity.startswith(("token:", "cert:")):
        return ""
    return p.identity


class Ownership:
    """The record-reading checks; a service this process does not run is not checked."""

    def __init__(self, registrar: RegistrarService | None, lease: LeaseService | None) -> None:
        self.registrar = registrar
        self.lease = lease

    async def _lease(self, conversation_id: str, lease_id: str = "") -> lease_pb2.LeaseInfo | None:
        assert self.lease is not None
        if lease_id:
            kv = await self.lease.store.get(self.lease._lkey(lease_id))
            return lease_pb2.LeaseInfo.FromString(kv.value) if kv else None
        _, _, info = await self.lease._read(conversation_id)
        return info

    async def may_revoke(self, conversation_id: str, lease_id: str) -> str:
        """Returns the lease id to revoke (the one checked, so a lease granted meanwhile
        is not revoked in its place)."""
        p = engine_caller()
        if p is None or self.lease is None or not conversation_id:
            return lease_id
        info = await self._lease(conversation_id, lease_id)
        if info is None:
            return lease_id  # the domain answers NOT_FOUND
        if info.engine_id not in p.engines:
            raise denied(f"{p.name} (engine) may not revoke lease {info.lease_id} of conversation {conversation_id}: "
                         f"it protects blocks of engine {info.engine_id}")
        return info.lease_id

    async def may_take(self, conversation_id: str, engine_id: str, verb: str) -> None:
        """Grant / retain for ``conversation_id`` on ``engine_id``: refused while another
        engine's lease on it lives."""
        p = engine_caller()
        if p is None or self.lease is None or not conversation_id:
            return
        try:
            info = await self._lease(conversation_id)
        except DomainError:
            return  # bad input: the domain answers it
        if info is not None and info.state in LIVE_STATES and info.engine_id != engine_id:
            if self.registrar is not None and not await self.registrar.engine_exists(info.engine_id):
                return  # the holder is gone (deregistered, or its liveness lapsed): so are its blocks
            raise denied(f"{p.name} (engine) may not {verb} for conversation {conversation_id}: its KV is held by "
                         f"engine {info.engine_id} under live lease {info.lease_id}; another engine takes it over "
                         "only after that lease ends or that engine is gone")

    async def may_release(self, conversation_id: str, retention_id: str) -> str:
        """Returns the retention id to release (the one checked)."""
        p = engine_caller()
        if p is None or self.registrar is None or not conversation_id:
            return retention_id
        try:
            rec = await self.registrar.lookup_retained(conversation_id)
        except DomainError:
            return retention_id  # nothing there (or bad input): the domain answers
        if retention_id and rec.retention_id != retention_id:
            return retention_id  # not that registration any more: releases nothing
        if rec.engine_id not in p.engines:
            raise denied(f"{p.name} (engine) may not release the retained blocks of conversation {conversation_id}: "
                         f"they are engine {rec.engine_id}'s")
        return rec.retention_id
