"""Metrics, ``kvbaton top`` and the status page, against a real control plane.

Each test starts a ``ControlPlane`` (on the memory store and on a real etcd) with
``/metrics`` on a free port, drives real gRPC traffic through it, then scrapes over HTTP
and checks the numbers. Each plane has its own registry, so values are exact.
"""

from __future__ import annotations

import asyncio
import pathlib
import shutil
import sys
import tempfile

import aiohttp
import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbaton.client import KvbatonClient
from kvbaton.services.domain.clock import WallClock
from kvbaton.services.metrics import metric_names
from kvbaton.services.server import ControlPlane
from kvbaton.v1 import common_pb2, lease_pb2
from kvbaton.v1 import rendezvous_pb2 as rpb
from tests.services.conftest import fast_config
from tests.services.helpers import register

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"
Samples = dict[tuple[str, frozenset], float]


@pytest.fixture
async def mplane(store):
    cp = ControlPlane(fast_config(metrics_address="127.0.0.1:0"), store=store, clock=WallClock())
    await cp.start()
    yield cp
    await cp.stop()


@pytest.fixture
async def mkv(mplane):
    client = KvbatonClient(mplane.address, timeout_s=5.0)
    await client.wait_ready()
    yield client
    await client.close()


async def scrape(url: str) -> Samples:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        async with s.get(url) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain")
            text = await r.text()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def val(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 when absent (a labelled series not yet touched)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum over every series of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


async def until(pred, timeout_s: float = 5.0, what: str = "condition") -> None:
    async def loop() -> None:
        while not await pred():
            await asyncio.sleep(0.05)
    try:
        await asyncio.wait_for(loop(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def offer(tid: str, *, timeout_ms: int = 0, blocks=(1, 2, 3)) -> rpb.OfferRequest:
    return rpb.OfferRequest(transfer_id=tid, decode_engine_id="dec", block_ids=list(blocks),
                            num_tokens=16 * len(blocks), timeout_ms=timeout_ms)


def complete(tid: str, *, timeout_ms: int = 0, blocks=(7, 8, 9)) -> rpb.CompleteRequest:
    return rpb.CompleteRequest(transfer_id=tid, prefill_engine_id="pre", block_ids=list(blocks),
                               num_tokens=16 * len(blocks), timeout_ms=timeout_ms, writers=1)


def outcome(tid: str, ok: bool, nbytes: int, duration_us: int = 0) -> rpb.ReportOutcomeRequest:
    return rpb.ReportOutcomeRequest(transfer_id=tid, outcome=rpb.Outcome(
        engine_id="pre", tp_rank=0, success=ok, bytes=nbytes, error="" if ok else "nixl: remote gone",
        duration_us=duration_us))


async def test_metrics_follow_rendezvous_traffic(mplane, mkv):
    kv, url = mkv, mplane.web.metrics_url
    await register(kv, "dec", common_pb2.ENGINE_ROLE_DECODE)
    await register(kv, "pre", common_pb2.ENGINE_ROLE_PREFILL, tp_size=2, tp_rank=0)
    await register(kv, "pre", common_pb2.ENGINE_ROLE_PREFILL, tp_size=2, tp_rank=1)

    # t-ok: offer first, writer succeeds. t-bad: completion first, writer fails.
    await kv.call(kv.rendezvous.Offer, offer("t-ok"))
    await asyncio.sleep(0.05)
    assert (await kv.call(kv.rendezvous.Complete, complete("t-ok"))).matched_now
    await kv.call(kv.rendezvous.Complete, complete("t-bad"))
    assert (await kv.call(kv.rendezvous.Offer, offer("t-bad"))).matched_now
    await kv.call(kv.rendezvous.Offer, offer("t-ok"))  # a duplicate: no second match
    await kv.call(kv.rendezvous.ReportOutcome, outcome("t-ok", True, 3 * 4096, duration_us=2_500))
    await kv.call(kv.rendezvous.ReportOutcome, outcome("t-ok", True, 3 * 4096))  # duplicate: not counted
    await kv.call(kv.rendezvous.ReportOutcome, outcome("t-bad", False, 100))
    # Unmatched sides that expire, one of each; a cancelled offer; one left pending.
    await kv.call(kv.rendezvous.Offer, offer("t-exp-o", timeout_ms=150))
    await kv.call(kv.rendezvous.Complete, complete("t-exp-c", timeout_ms=150))
    await kv.call(kv.rendezvous.Offer, offer("t-cancel"))
    await kv.call(kv.rendezvous.Cancel, rpb.CancelRequest(transfer_id="t-cancel", engine_id="dec", reason="test"))
    await kv.call(kv.rendezvous.Offer, offer("t-pending"))
    # A match with a block-count mismatch fails at once.
    await kv.call(kv.rendezvous.Offer, offer("t-mismatch", blocks=(1, 2)))
    await kv.call(kv.rendezvous.Complete, complete("t-mismatch"))

    async def expired() -> bool:
        s = await scrape(url)
        return total(s, "kvbaton_rendezvous_expired_total") >= 2
    await until(expired, what="both unmatched sides to expire")
    s = await scrape(url)

    assert val(s, "kvbaton_rendezvous_matches_total") == 2
    assert val(s, "kvbaton_rendezvous_match_wait_seconds_count", first_side="offer") == 1
    assert val(s, "kvbaton_rendezvous_match_wait_seconds_count", first_side="completion") == 1
    # The offer of t-ok waited >= 50 ms for its completion.
    assert val(s, "kvbaton_rendezvous_match_wait_seconds_sum", first_side="offer") >= 0.04
    assert val(s, "kvbaton_rendezvous_match_wait_seconds_bucket", first_side="offer", le="0.01") == 0
    assert val(s, "kvbaton_rendezvous_match_to_outcome_seconds_count", outcome="succeeded") == 1
    assert val(s, "kvbaton_rendezvous_match_to_outcome_seconds_count", outcome="failed") == 1
    assert val(s, "kvbaton_transfers_total", outcome="succeeded", reason="reported") == 1
    assert val(s, "kvbaton_transfers_total", outcome="failed", reason="reported") == 1
    assert val(s, "kvbaton_transfers_total", outcome="failed", reason="block_count_mismatch") == 1
    assert val(s, "kvbaton_transfers_total", outcome="cancelled", reason="cancelled") == 1
    assert val(s, "kvbaton_transfers_total", outcome="expired", reason="unmatched") == 2
    assert val(s, "kvbaton_rendezvous_expired_total", side="offer") == 1
    assert val(s, "kvbaton_rendezvous_expired_total", side="completion") == 1
    assert val(s, "kvbaton_transfer_bytes_total", mode="push", outcome="succeeded") == 3 * 4096
    assert val(s, "kvbaton_transfer_bytes_total", mode="push", outcome="failed") == 100
    assert val(s, "kvbaton_transfer_write_seconds_count", mode="push") == 1
    assert val(s, "kvbaton_transfer_write_seconds_sum", mode="push") == pytest.approx(0.0025)
    assert val(s, "kvbaton_transfers_pending", phase="offered") == 1
    assert val(s, "kvbaton_transfers_pending", phase="matched") == 0
    # Engines: distinct ids and ranks, by role; registrations counted per rank.
    assert val(s, "kvbaton_engines", role="decode") == 1 and val(s, "kvbaton_engines", role="prefill") == 1
    assert val(s, "kvbaton_engine_ranks", role="prefill") == 2
    assert val(s, "kvbaton_engine_registrations_total", role="prefill") == 2
    assert val(s, "kvbaton_leader", duty="rendezvous-sweeper") == 1
    backend = type(mplane.store).__name__.removesuffix("Store").lower()
    assert val(s, "kvbaton_store_operation_seconds_count", op="txn", backend=backend) >= 8
    assert val(s, "kvbaton_store_operation_seconds_count", op="get", backend=backend) >= 1


async def test_metrics_follow_lease_traffic(mplane, mkv):
    kv, url = mkv, mplane.web.metrics_url
    lp = lease_pb2

    async def grant(conv: str, ttl_ms: int, blocks: int = 4) -> lp.GrantResponse:
        return await kv.call(kv.lease.Grant, lp.GrantRequest(conversation_id=conv, engine_id="dec", ttl_ms=ttl_ms,
                                                             num_blocks=blocks))

    await register(kv, "dec", common_pb2.ENGINE_ROLE_DECODE)  # pins need a live decode engine
    short = (await grant("c-short", 300, blocks=3)).lease
    long = (await grant("c-long", 5_000, blocks=5)).lease
    await grant("c-repl", 5_000, blocks=2)
    s = await scrape(url)
    assert val(s, "kvbaton_leases", state="active") == 3
    assert val(s, "kvbaton_retained_blocks", engine="dec") == 10

    # 30 renewals in quick succession: answered from the cache after at most a couple
    # of writes (the written deadline carries slack).
    for _ in range(30):
        r = await kv.call(kv.lease.Renew, lp.RenewRequest(conversation_id="c-long", lease_id=long.lease_id))
        assert r.status == lp.RENEW_STATUS_OK
    await kv.call(kv.lease.Renew, lp.RenewRequest(conversation_id="nobody"))
    pin = (await kv.call(kv.lease.Pin, lp.PinRequest(conversation_id="c-long", lease_id=long.lease_id,
                                                      reader="pre", ttl_ms=10_000))).pin
    await grant("c-repl", 5_000, blocks=2)  # replaces the unpinned lease: it ends at once
    # Revoking the pinned lease drains it; the unpin ends it.
    await kv.call(kv.lease.Revoke, lp.RevokeRequest(conversation_id="c-long", reason="operator"))
    s = await scrape(url)
    assert val(s, "kvbaton_leases", state="draining") == 1
    await kv.call(kv.lease.Unpin, lp.UnpinRequest(conversation_id="c-long", lease_id=long.lease_id, pin_id=pin.pin_id))

    async def short_ended() -> bool:
        return val(await scrape(url), "kvbaton_lease_ends_total", reason="expired") >= 1
    await until(short_ended, what="c-short to expire")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.lease.Pin, lp.PinRequest(conversation_id="c-short", lease_id=short.lease_id, reader="pre"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    s = await scrape(url)
    assert val(s, "kvbaton_lease_grants_total") == 4
    assert val(s, "kvbaton_lease_renewals_total", status="ok") == 30
    assert val(s, "kvbaton_lease_renewals_total", status="not_found") == 1
    writes = val(s, "kvbaton_lease_renewal_writes_total")
    assert 1 <= writes <= 5, writes  # 30 renewals, a few writes
    assert 1 <= val(s, "kvbaton_lease_renewal_txns_total") <= writes
    assert val(s, "kvbaton_lease_pins_total") == 1
    assert val(s, "kvbaton_lease_pin_refusals_total", reason="ended") == 1
    assert val(s, "kvbaton_lease_ends_total", reason="expired") == 1
    assert val(s, "kvbaton_lease_ends_total", reason="replaced") == 1
    assert val(s, "kvbaton_lease_ends_total", reason="revoked") == 1
    assert val(s, "kvbaton_leases", state="active") == 1  # the new c-repl
    assert val(s, "kvbaton_leases", state="draining") == 0
    assert val(s, "kvbaton_retained_blocks", engine="dec") == 2
    assert val(s, "kvbaton_leader", duty="lease-expiry") == 1


async def test_every_exported_name_is_declared(mplane, mkv):
    """What a scrape returns is a subset of ``metric_names()`` (what dashboards may use)."""
    await register(mkv, "dec", common_pb2.ENGINE_ROLE_DECODE)
    s = await scrape(mplane.web.metrics_url)
    exported = {name for name, _ in s if name.startswith("kvbaton_")}
    assert exported and exported <= metric_names(), exported - metric_names()
    assert all(not n.startswith("kvbaton_") or n in metric_names() for n, _ in s)


async def _seed(kv) -> None:
    """A little of everything, for the views. Nothing lapses for minutes: a view rendered
    late (a headless browser or a CLI child starting on a loaded machine can take tens of
    seconds) shows all of it."""
    await register(kv, "dec-0", common_pb2.ENGINE_ROLE_DECODE, ttl_ms=600_000)
    await register(kv, "pre-0", common_pb2.ENGINE_ROLE_PREFILL, ttl_ms=600_000)
    for i in range(3):
        await kv.call(kv.rendezvous.Offer, rpb.OfferRequest(transfer_id=f"xfer-{i}", decode_engine_id="dec-0",
                                                            block_ids=[1, 2, 3, 4], num_tokens=64, timeout_ms=600_000))
    for i, ttl in enumerate((600_000, 200_000, 400_000)):
        await kv.call(kv.lease.Grant, lease_pb2.GrantRequest(conversation_id=f"conv-{i}", engine_id="dec-0",
                                                             ttl_ms=ttl, num_blocks=8 + i))
    for _ in range(5):
        await kv.call(kv.lease.Renew, lease_pb2.RenewRequest(conversation_id="conv-0"))


async def test_top_once_prints_one_frame(mplane, mkv):
    await _seed(mkv)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvbaton.cli", "top", "--once", "--addr", mplane.address,
        "--metrics", mplane.web.metrics_url, "--interval", "0.3",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT)
    async def renew_while_running() -> None:
        # Renewals through the rate window (whenever the child gets to it), so renewals/s > 0.
        while proc.returncode is None:
            await mkv.call(mkv.lease.Renew, lease_pb2.RenewRequest(conversation_id="conv-1"))
            await asyncio.sleep(0.02)

    renewer = asyncio.create_task(renew_while_running())
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await asyncio.wait_for(renewer, 10)
    text = out.decode()
    assert proc.returncode == 0, err.decode()
    assert "\x1b[" not in text  # --once: no escapes
    assert "engines 2  pending transfers 3  leases 3 active / 0 draining" in text
    for word in ("ENGINES", "dec-0", "pre-0", "PENDING TRANSFERS", "xfer-0", "offered", "LEASES EXPIRING SOONEST"):
        assert word in text, word
    lease_lines = [line for line in text.splitlines() if line.startswith("conv-")]
    assert [line.split()[0] for line in lease_lines] == ["conv-1", "conv-2", "conv-0"]  # soonest first
    rates_line = next(line for line in text.splitlines() if line.startswith("matches/s"))
    renewals = float(rates_line.split("renewals/s ")[1].split()[0])
    assert renewals > 0, rates_line


async def test_top_without_metrics_says_rates_are_unavailable(mplane, mkv):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvbaton.cli", "top", "--once", "--addr", mplane.address, "--interval", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert "matches/s n/a" in out.decode() and "(none)" in out.decode()


async def test_api_state_and_page(mplane, mkv):
    await _seed(mkv)
    base = mplane.web.page_url.rstrip("/")
    await asyncio.sleep(1.2)  # one sampler tick, so the rates have a window
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        async with s.get(base + "/api/state") as r:
            assert r.status == 200 and r.content_type == "application/json"
            state = await r.json()
        async with s.get(base + "/") as r:
            assert r.status == 200 and r.content_type == "text/html"
            page = await r.text()
        async with s.get(base + "/?refresh=0") as r:
            assert r.status == 200
            still = await r.text()
        async with s.get(base + "/?refresh=soon") as r:
            assert r.status == 400 and "refresh" in await r.text()
        async with s.get(base + "/healthz") as r:
            assert r.status == 200
    assert "http-equiv" not in still and "xfer-2" in still  # a capture's page does not reload itself
    assert {e["engine_id"]: e["role"] for e in state["engines"]} == {"dec-0": "decode", "pre-0": "prefill"}
    assert state["transfers"]["counts"]["offered"] == 3
    assert [t["transfer_id"] for t in state["transfers"]["items"]] == ["xfer-0", "xfer-1", "xfer-2"]
    assert [lr["conversation_id"] for lr in state["leases"]["expiring_soonest"]] == ["conv-1", "conv-2", "conv-0"]
    assert state["leases"]["active"] == 3 and state["leases"]["retained_blocks"] == {"dec-0": 27}
    assert state["totals"]["lease_renewals_total"] == 5
    assert state["leader"] == {"lease-expiry": True, "rendezvous-sweeper": True}
    assert set(state["rates"]) >= {"matches_per_s", "renewals_per_s"}
    assert '<meta http-equiv="refresh" content="1">' in page
    for word in ("dec-0", "xfer-2", "conv-1", "Leases expiring soonest", "renewals/s"):
        assert word in page, word


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(_chromium() is None, reason="chromium not installed (apt-get install -y chromium)")
async def test_status_page_renders_in_headless_chromium(store_kind, store):
    if store_kind != "memory":
        pytest.skip("one screenshot is enough")
    cp = ControlPlane(fast_config(metrics_address="127.0.0.1:0"), store=store, clock=WallClock())
    await cp.start()
    try:
        async with KvbatonClient(cp.address, timeout_s=5.0) as kv:
            await kv.wait_ready()
            await _seed(kv)
            ARTIFACTS.mkdir(exist_ok=True)
            shot = ARTIFACTS / "status_page.png"
            dom = ARTIFACTS / "status_page.html"
            shot.unlink(missing_ok=True)
            with tempfile.TemporaryDirectory(prefix="kvb-chromium-") as profile:
                flags = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                         "--disable-component-update", "--disable-sync", "--no-first-run",
                         f"--user-data-dir={profile}", "--window-size=1280,900", "--hide-scrollbars"]
                for extra in ([f"--screenshot={shot}"], ["--dump-dom"]):
                    proc = await asyncio.create_subprocess_exec(
                        *flags, *extra, cp.web.page_url + "?refresh=0", stdout=asyncio.subprocess.PIPE,
                        stderr=asyncio.subprocess.PIPE, cwd=ARTIFACTS)
                    try:
                        out, err = await asyncio.wait_for(proc.communicate(), 90)
                    except TimeoutError:
                        proc.kill()
                        await proc.wait()
                        raise
                    assert proc.returncode == 0, err.decode()[-2000:]
                    if "--dump-dom" in extra:
                        dom.write_bytes(out)
        assert shot.exists() and shot.stat().st_size > 10_000
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        rendered = dom.read_text()
        for word in ("dec-0", "xfer-0", "conv-1", "Pending transfers"):
            assert word in rendered, word
    finally:
        await cp.stop()
