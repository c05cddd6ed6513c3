"""A request that finds no routable engine of a role waits for one (``services/router/role_wait.py``):
served once an engine of the role registers, 503 + ``Retry-After`` after ``--role-wait-s``,
503 at once past ``--role-wait-max`` waiting, and it stops waiting when its client goes.
Real router app, real control plane (in-process gRPC, memory store) and stand-in engines
(``test_router_fleet.py``); every wait is synchronised on the router reporting the request
as waiting (``/kvbaton/stats``), then the fleet is changed."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbaton.v1 import common_pb2
from tests.router.test_router_fleet import _register, _until, fleet, plane  # noqa: F401 - fixtures

PREFILL, DECODE = common_pb2.ENGINE_ROLE_PREFILL, common_pb2.ENGINE_ROLE_DECODE
BODY = {"prompt": "hi", "max_tokens": 2}


async def _role_wait(fleet, router: str) -> dict:  # noqa: F811
    async with fleet.session.get(router + "/kvbaton/stats") as r:
        return (await r.json())["role_wait"]


async def _waiting(fleet, router: str, role: str, n: int = 1) -> None:  # noqa: F811
    async def reported() -> bool:
        return (await _role_wait(fleet, router))["waiting"][role] == n
    await _until(reported, 5.0)


@pytest.mark.parametrize("missing", ["prefill", "decode"])
async def test_a_request_waits_for_the_missing_role_and_is_served_when_one_registers(fleet, plane, missing):  # noqa: F811
    role = {"prefill": PREFILL, "decode": DECODE}
    here = "decode" if missing == "prefill" else "prefill"
    await _register(plane.kv, f"{here[0]}0", await fleet.engine(f"{here[0]}0"), role[here])
    router = await fleet.router(mode="pull", control_plane=plane.address, role_wait_s=20)
    late = await fleet.engine(f"{missing[0]}0")
    sent = asyncio.create_task(fleet.post(router, BODY))
    await _waiting(fleet, router, missing)
    assert not sent.done()
    await _register(plane.kv, f"{missing[0]}0", late, role[missing])
    status, headers, _ = await asyncio.wait_for(sent, 10)
    assert status == 200 and headers["X-Kvbaton-Prefill"] == "p0" and headers["X-Kvbaton-Decode"] == "d0"
    got = await _role_wait(fleet, router)
    assert got["waiting"] == {"prefill": 0, "decode": 0}
    assert got["outcomes"][missing] == {"served": 1, "timed_out": 0, "shed": 0, "client_gone": 0}


async def test_a_request_that_waits_past_role_wait_s_gets_503_with_retry_after(fleet, plane):  # noqa: F811
    await _register(plane.kv, "d0", await fleet.engine("d0"), DECODE)
    router = await fleet.router(mode="pull", control_plane=plane.address, role_wait_s=1.5)
    t0 = time.monotonic()
    sent = asyncio.create_task(fleet.post(router, BODY))
    await _waiting(fleet, router, "prefill")
    # A change of the fleet that brings no prefill: the request looks again and waits on.
    await _register(plane.kv, "d1", await fleet.engine("d1"), DECODE)
    status, headers, raw = await asyncio.wait_for(sent, 10)
    took = time.monotonic() - t0
    assert status == 503 and headers["Retry-After"] == "2"
    assert b"no prefill engine available: waited 1.5 s" in raw
    assert 1.4 <= took < 5.0, took
    got = await _role_wait(fleet, router)
    assert got["outcomes"]["prefill"]["timed_out"] == 1 and got["waiting"]["prefill"] == 0
    assert fleet.engines["d0"].bodies == fleet.engines["d1"].bodies == []


async def test_past_role_wait_max_a_request_is_shed_at_once_with_a_reason(fleet, plane):  # noqa: F811
    await _register(plane.kv, "d0", await fleet.engine("d0"), DECODE)
    router = await fleet.router(mode="pull", control_plane=plane.address, role_wait_s=20, role_wait_max=1)
    first = asyncio.create_task(fleet.post(router, BODY))
    await _waiting(fleet, router, "prefill")
    t0 = time.monotonic()
    status, headers, raw = await fleet.post(router, BODY)
    assert time.monotonic() - t0 < 2.0
    assert status == 503 and headers["Retry-After"] == "20" and b"--role-wait-max" in raw
    await _register(plane.kv, "p0", await fleet.engine("p0"), PREFILL)
    assert (await asyncio.wait_for(first, 10))[0] == 200
    got = await _role_wait(fleet, router)
    assert got["outcomes"]["prefill"] == {"served": 1, "timed_out": 0, "shed": 1, "client_gone": 0}
    async with fleet.session.get(router + "/metrics") as r:
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(await r.text()) for s in fam.samples}
    assert samples[("kvbaton_router_role_waits_total", (("outcome", "shed"), ("role", "prefill")))] >= 1
    assert samples[("kvbaton_router_role_waiting", (("role", "prefill"),))] == 0


async def test_a_client_that_disconnects_stops_waiting(fleet, plane):  # noqa: F811
    await _register(plane.kv, "d0", await fleet.engine("d0"), DECODE)
    router = await fleet.router(mode="pull", control_plane=plane.address, role_wait_s=60)
    host, port = router.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = b'{"prompt": "hi", "max_tokens": 2}'
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    await _waiting(fleet, router, "prefill")
    writer.close()
    await writer.wait_closed()

    async def gone() -> bool:
        got = await _role_wait(fleet, router)
        return got["waiting"]["prefill"] == 0 and got["outcomes"]["prefill"]["client_gone"] == 1
    assert await _until(gone, 5.0) < 3.0
    # What came before still works: a prefill registers, a request is served at once.
    await _register(plane.kv, "p0", await fleet.engine("p0"), PREFILL)

    async def served() -> bool:
        return (await fleet.post(router, BODY))[0] == 200
    await _until(served, 5.0)
    assert (await _role_wait(fleet, router))["outcomes"]["prefill"]["served"] == 0  # it never waited


async def test_role_wait_0_answers_503_at_once(fleet, plane):  # noqa: F811
    await _register(plane.kv, "d0", await fleet.engine("d0"), DECODE)
    router = await fleet.router(mode="pull", control_plane=plane.address, role_wait_s=0)
    t0 = time.monotonic()
    status, headers, raw = await fleet.post(router, BODY)
    assert time.monotonic() - t0 < 2.0
    assert status == 503 and b"no prefill engine available" in raw and headers["Retry-After"] == "1"
    assert (await _role_wait(fleet, router))["outcomes"]["prefill"] == {
        "served": 0, "timed_out": 0, "shed": 0, "client_gone": 0}


async def test_a_static_engine_that_failed_is_tried_again_without_waiting(fleet):  # noqa: F811
    """A static list never waits: its only prefill, suspect after a transport error, is
    still tried (502 while it is down), and serves again as soon as it is back."""
    p, d = await fleet.engine("p0"), await fleet.engine("d0")
    router = await fleet.router([f"p0={p}"], [f"d0={d}"], "pull", control_plane="", role_wait_s=30)
    fleet.engines["p0"].die = True
    t0 = time.monotonic()
    for _ in range(2):
        status, _, raw = await fleet.post(router, BODY)
        assert status == 502 and b"prefill engine unreachable" in raw
    fleet.engines["p0"].die = False
    status, headers, _ = await fleet.post(router, BODY)
    assert status == 200 and headers["X-Kvbaton-Prefill"] == "p0"
    assert time.monotonic() - t0 < 10.0
    got = await _role_wait(fleet, router)
    assert got["waiting"] == {"prefill": 0, "decode": 0}
    assert all(n == 0 for c in got["outcomes"].values() for n in c.values())
