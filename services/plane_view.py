"""What the HTTP side (``services/web.py``) reads from a running control plane.

Why a module of its own: ``services/server.py`` starts the web server, and the web server
reads the plane's config, metrics and domains. Describing that read-only view here as a
``Protocol`` lets both depend on this module instead of on each other (``ControlPlane``
satisfies it structurally; mypy checks it where the plane hands itself to ``WebServer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .domain.clock import Clock
from .domain.lease import LeaseService
from .domain.registrar import RegistrarService
from .domain.rendezvous import RendezvousService
from .metrics import ServiceMetrics
from .store.base import Store


class WebSettings(Protocol):
    """The part of ``ServerConfig`` the web server reads."""

    @property
    def metrics_address(self) -> str | None: ...
    @property
    def web_address(self) -> str | None: ...
    @property
    def services(self) -> Sequence[str]: ...


class PlaneView(Protocol):
    """A started control plane, as the metrics endpoint and the status page see it."""

    @property
    def config(self) -> WebSettings: ...
    @property
    def metrics(self) -> ServiceMetrics: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def address(self) -> str: ...
    @property
    def store(self) -> Store | None: ...
    @property
    def registrar(self) -> RegistrarService | None: ...
    @property
    def rendezvous(self) -> RendezvousService | None: ...
    @property
    def lease(self) -> LeaseService | None: ...

    def leadership(self) -> dict[str, bool]:
        """Election name -> whether this replica leads it now."""
        ...

    async def refresh_state_gauges(self, timeout_s: float = 2.0) -> None:
        """Bring the gauges computed from the domains' state up to date (bounded)."""
        ...
