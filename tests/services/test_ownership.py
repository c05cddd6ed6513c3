"""The hijacks of issue 16, each tried against a real server with tokens, each refused
with PERMISSION_DENIED / UNAUTHENTICATED and a reason, and shown to have changed nothing.

Cast: engines ``pre`` (prefill) and ``dec`` (decode) and their router; ``evil`` is an
engine with a valid token of its own (a compromised engine), trying to steer KV it does
not own.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest

from kvbaton.client import KvbatonClient
from kvbaton.services.server import ControlPlane
from kvbaton.services.store import MemoryStore
from kvbaton.v1 import common_pb2, lease_pb2, registrar_pb2, rendezvous_pb2
from tests.services.conftest import fast_config
from tests.services.helpers import engine_rank

TOKENS = {
    "pre": ("tok-prefill-0123456789abcdef", {"name": "prefill-0", "role": "engine", "engines": ["pre"]}),
    "dec": ("tok-decode-0123456789abcdefg", {"name": "decode-0", "role": "engine", "engines": ["dec"]}),
    "dec2": ("tok-decode-second-token-012345", {"name": "decode-0", "role": "engine", "engines": ["dec"]}),
    "evil": ("tok-evil-engine-0123456789ab", {"name": "evil", "role": "engine", "engines": ["evil"]}),
    "router": ("tok-router-0123456789abcdef", {"name": "router", "role": "router"}),
    "ops": ("tok-operator-0123456789abcd", {"name": "oncall", "role": "operator"}),
}
DECODE, PREFILL = common_pb2.ENGINE_ROLE_DECODE, common_pb2.ENGINE_ROLE_PREFILL


def _token_file(tmp_path) -> str:
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"tokens": [{"token": tok, **entry} for tok, entry in TOKENS.values()]}))
    return str(path)


@pytest.fixture
async def rig(tmp_path):
    cp = ControlPlane(fast_config(tokens_file=_token_file(tmp_path), metrics_address="127.0.0.1:0"),
                      store=MemoryStore())
    await cp.start()
    c = {who: KvbatonClient(cp.address, timeout_s=3, token=tok) for who, (tok, _) in TOKENS.items()}
    c["none"] = KvbatonClient(cp.address, timeout_s=3)
    for who, eid, role in (("pre", "pre", PREFILL), ("dec", "dec", DECODE), ("evil", "evil", DECODE)):
        await c[who].registrar.RegisterEngine(registrar_pb2.RegisterEngineRequest(rank=engine_rank(eid, role)), timeout=3)
    yield cp, c
    for kv in c.values():
        await kv.close()
    await cp.stop()


async def _refused(coro, code=grpc.StatusCode.PERMISSION_DENIED) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    assert err.value.code() == code, err.value.details()
    assert err.value.details(), "a refusal says why"
    return err.value.details()


async def _state(c, tid: str) -> rendezvous_pb2.TransferState:
    return await c["ops"].rendezvous.GetTransfer(rendezvous_pb2.GetTransferRequest(transfer_id=tid), timeout=3)


def _offer(tid, engine, *, peer="pre", attempt=0, blocks=(1, 2)):
    return rendezvous_pb2.OfferRequest(transfer_id=tid, attempt=attempt, decode_engine_id=engine,
                                       block_ids=list(blocks), num_tokens=16, prefill_engine_id=peer)


def _complete(tid, engine, *, peer="dec", attempt=0, blocks=(7, 8)):
    return rendezvous_pb2.CompleteRequest(transfer_id=tid, attempt=attempt, prefill_engine_id=engine,
                                          block_ids=list(blocks), num_tokens=16, decode_engine_id=peer)


async def test_an_engine_cannot_offer_on_a_transfer_bound_to_another_decode(rig):
    cp, c = rig
    await c["pre"].rendezvous.Complete(_complete("t-1", "pre"), timeout=3)
    # The prefill named "dec": evil (under its own id, even naming "pre") is refused...
    why = await _refused(c["evil"].rendezvous.Offer(_offer("t-1", "evil"), timeout=3))
    assert "bound to decode engine dec" in why
    assert (await _state(c, "t-1")).phase == rendezvous_pb2.TRANSFER_PHASE_COMPLETED
    # ... and the named decode matches, with its own blocks.
    resp = await c["dec"].rendezvous.Offer(_offer("t-1", "dec"), timeout=3)
    assert resp.matched_now and resp.state.offer.engine_id == "dec"


async def test_an_impostor_offer_made_first_is_dropped_not_matched(rig):
    cp, c = rig
    # evil offers first on a transfer id it learnt, naming the real prefill...
    await c["evil"].rendezvous.Offer(_offer("t-2", "evil", blocks=(66,)), timeout=3)
    # ... the prefill's completion names "dec": evil's offer is dropped, nothing matches it.
    resp = await c["pre"].rendezvous.Complete(_complete("t-2", "pre"), timeout=3)
    assert not resp.matched_now and not resp.state.offer.engine_id
    assert resp.state.phase == rendezvous_pb2.TRANSFER_PHASE_COMPLETED
    resp = await c["dec"].rendezvous.Offer(_offer("t-2", "dec"), timeout=3)
    assert resp.matched_now and list(resp.state.offer.block_ids) == [1, 2]


async def test_a_fake_prefill_cannot_complete_into_a_decodes_offer(rig):
    cp, c = rig
    await c["dec"].rendezvous.Offer(_offer("t-3", "dec"), timeout=3)
    why = await _refused(c["evil"].rendezvous.Complete(_complete("t-3", "evil"), timeout=3))
    assert "bound to prefill engine pre" in why
    assert (await _state(c, "t-3")).phase == rendezvous_pb2.TRANSFER_PHASE_OFFERED


async def test_unbound_transfers_are_refused_when_tokens_are_on(rig):
    cp, c = rig
    await _refused(c["dec"].rendezvous.Offer(_offer("t-4", "dec", peer=""), timeout=3), grpc.StatusCode.INVALID_ARGUMENT)
    await _refused(c["pre"].rendezvous.Complete(_complete("t-4", "pre", peer=""), timeout=3),
                   grpc.StatusCode.INVALID_ARGUMENT)


async def test_only_parties_start_a_new_attempt_and_only_by_a_bounded_step(rig):
    cp, c = rig
    await c["pre"].rendezvous.Complete(_complete("t-5", "pre"), timeout=3)
    # evil cannot supersede (cancel) someone else's transfer, nor pre-empt it for good.
    for attempt in (1, 2**32 - 1):
        why = await _refused(c["evil"].rendezvous.Offer(_offer("t-5", "evil", attempt=attempt), timeout=3))
        assert "not a party" in why
    state = await _state(c, "t-5")
    assert state.attempt == 0 and state.phase == rendezvous_pb2.TRANSFER_PHASE_COMPLETED
    # A party may retry, by a bounded step.
    await _refused(c["pre"].rendezvous.Complete(_complete("t-5", "pre", attempt=2**32 - 1), timeout=3),
                   grpc.StatusCode.INVALID_ARGUMENT)
    resp = await c["pre"].rendezvous.Complete(_complete("t-5", "pre", attempt=1), timeout=3)
    assert resp.state.attempt == 1
    # A brand-new transfer cannot start at an attempt nobody could supersede either.
    await _refused(c["dec"].rendezvous.Offer(_offer("t-6", "dec", attempt=2**32 - 1), timeout=3),
                   grpc.StatusCode.INVALID_ARGUMENT)


async def test_an_engine_cannot_revoke_or_take_over_another_engines_conversation(rig):
    cp, c = rig
    await c["dec"].registrar.RegisterRetained(registrar_pb2.RegisterRetainedRequest(retained=registrar_pb2.RetainedBlocks(
        conversation_id="conv-1", engine_id="dec", block_ids=[1, 2], num_tokens=32, tokens_per_block=16)), timeout=3)
    lease = (await c["dec"].lease.Grant(lease_pb2.GrantRequest(conversation_id="conv-1", engine_id="dec",
                                                               ttl_ms=60_000), timeout=3)).lease
    # Revoke decode's lease: refused.
    why = await _refused(c["evil"].lease.Revoke(lease_pb2.RevokeRequest(conversation_id="conv-1"), timeout=3))
    assert "engine dec" in why
    await _refused(c["evil"].lease.Revoke(lease_pb2.RevokeRequest(conversation_id="conv-1", lease_id=lease.lease_id),
                                          timeout=3))
    # KV injection: Grant + RegisterRetained under its own engine id for decode's conversation.
    why = await _refused(c["evil"].lease.Grant(lease_pb2.GrantRequest(conversation_id="conv-1", engine_id="evil",
                                                                      ttl_ms=60_000), timeout=3))
    assert "held by engine dec" in why
    await _refused(c["evil"].registrar.RegisterRetained(registrar_pb2.RegisterRetainedRequest(
        retained=registrar_pb2.RetainedBlocks(conversation_id="conv-1", engine_id="evil", block_ids=[9],
                                              num_tokens=16, tokens_per_block=16)), timeout=3))
    # Release decode's retained blocks: refused.
    await _refused(c["evil"].registrar.ReleaseRetained(registrar_pb2.ReleaseRetainedRequest(conversation_id="conv-1"),
                                                       timeout=3))
    # Nothing changed: the router still finds decode's blocks under decode's live lease.
    got = await c["router"].lease.Get(lease_pb2.GetLeaseRequest(conversation_id="conv-1"), timeout=3)
    assert got.lease_id == lease.lease_id and got.state == lease_pb2.LEASE_STATE_ACTIVE
    ret = await c["router"].registrar.LookupRetained(registrar_pb2.LookupRetainedRequest(conversation_id="conv-1"),
                                                     timeout=3)
    assert ret.retained.engine_id == "dec"
    # The owner may do all of it; once the lease ended, another engine may take over.
    listed = await c["dec"].lease.List(lease_pb2.ListLeasesRequest(engine_id="dec"), timeout=3)
    assert [x.conversation_id for x in listed.leases] == ["conv-1"]
    await _refused(c["dec"].lease.List(lease_pb2.ListLeasesRequest(), timeout=3))  # all engines': not an engine's
    await c["dec"].lease.Revoke(lease_pb2.RevokeRequest(conversation_id="conv-1"), timeout=3)
    await c["evil"].lease.Grant(lease_pb2.GrantRequest(conversation_id="conv-1", engine_id="evil", ttl_ms=60_000),
                                timeout=3)


async def test_re_registering_an_engine_id_needs_the_same_identity(rig):
    cp, c = rig
    original = (await c["ops"].registrar.GetEngine(registrar_pb2.GetEngineRequest(engine_id="dec"), timeout=3)).ranks[0]
    # A second token scoped to "dec" (same name, another identity) cannot replace the metadata ...
    rogue = engine_rank("dec", DECODE)
    rogue.agent_metadata = b"attacker-agent"
    why = await _refused(c["dec2"].registrar.RegisterEngine(registrar_pb2.RegisterEngineRequest(rank=rogue), timeout=3))
    assert "another identity" in why
    await _refused(c["dec2"].registrar.DeregisterEngine(registrar_pb2.DeregisterEngineRequest(engine_id="dec"),
                                                        timeout=3))
    now = (await c["ops"].registrar.GetEngine(registrar_pb2.GetEngineRequest(engine_id="dec"), timeout=3)).ranks[0]
    assert now.agent_metadata == original.agent_metadata and now.incarnation == original.incarnation
    # ... the engine itself may (a restart), and the owner record is never shown.
    again = await c["dec"].registrar.RegisterEngine(registrar_pb2.RegisterEngineRequest(rank=engine_rank("dec", DECODE)),
                                                    timeout=3)
    assert again.rank.incarnation != original.incarnation
    assert all(r.engine_id != "" for r in (await c["ops"].registrar.ListEngines(
        registrar_pb2.ListEnginesRequest(), timeout=3)).ranks)


async def test_reserved_engine_ids_are_refused(rig, tmp_path):
    cp, c = rig
    sub = c["ops"].rendezvous.Subscribe(rendezvous_pb2.SubscribeRequest(engine_id="*"))
    await _refused(sub.read(), grpc.StatusCode.INVALID_ARGUMENT)
    await _refused(c["ops"].registrar.RegisterEngine(registrar_pb2.RegisterEngineRequest(
        rank=engine_rank("*", DECODE)), timeout=3), grpc.StatusCode.INVALID_ARGUMENT)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"tokens": [{"token": "x" * 20, "name": "wild", "role": "engine", "engines": ["*"]}]}))
    from kvbaton.services.auth import TokenBook

    with pytest.raises(ValueError, match="reserved"):
        TokenBook.load(bad)


async def test_no_credentials_get_nothing(rig):
    cp, c = rig
    # The insecure-deploy hijack, now: list, register a fake decode, subscribe to everything.
    await _refused(c["none"].registrar.ListEngines(registrar_pb2.ListEnginesRequest(), timeout=3),
                   grpc.StatusCode.UNAUTHENTICATED)
    await _refused(c["none"].registrar.RegisterEngine(registrar_pb2.RegisterEngineRequest(
        rank=engine_rank("evil-decode", DECODE)), timeout=3), grpc.StatusCode.UNAUTHENTICATED)
    await _refused(c["none"].rendezvous.ListTransfers(rendezvous_pb2.ListTransfersRequest(), timeout=3),
                   grpc.StatusCode.UNAUTHENTICATED)


async def test_state_page_needs_an_operator_token(rig):
    cp, c = rig
    url = cp.web.page_url.rstrip("/")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for headers, status in (({}, 401), ({"Authorization": "Bearer not-a-token-at-all"}, 401),
                                ({"Authorization": f"Bearer {TOKENS['router'][0]}"}, 403),
                                ({"Authorization": f"Bearer {TOKENS['ops'][0]}"}, 200)):
            for path in ("/api/state", "/"):
                async with http.get(url + path, headers=headers) as r:
                    assert r.status == status, (path, headers, await r.text())
        async with http.get(cp.web.metrics_url) as r:
            assert r.status == 200  # counts only: scraped without a token


@pytest.mark.parametrize("tokens", [True, False], ids=["tokens", "client-certificates"])
async def test_flooding_client_never_drains_another_identitys_bucket(tmp_path, tokens):
    """Two engine tokens, one flooding: the other is never refused. Without tokens, two
    client certificates under mutual TLS likewise, on unary calls and KeepAlive messages
    (where every message used to count against one shared "anonymous" bucket)."""
    if True:
        cfg = fast_config(rate_limit=20.0)
        if tokens:
            cfg.tokens_file = _token_file(tmp_path)
        else:
            pytest.importorskip("cryptography")
            from tests.harness.pki import TestCA

            ca = TestCA(tmp_path / "pki")
            server, one, two = ca.server("cp"), ca.client("engine-one"), ca.client("engine-two")
            cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca, cfg.insecure = server.cert, server.key, ca.ca, False
        cp = ControlPlane(cfg, store=MemoryStore())
        await cp.start()
        if tokens:
            flood = KvbatonClient(cp.address, timeout_s=3, token=TOKENS["evil"][0])
            calm = KvbatonClient(cp.address, timeout_s=3, token=TOKENS["dec"][0])
        else:
            from kvbaton.client import ClientTls

            flood = KvbatonClient(cp.address, timeout_s=3, tls=ClientTls(ca.ca, one.cert, one.key))
            calm = KvbatonClient(cp.address, timeout_s=3, tls=ClientTls(ca.ca, two.cert, two.key))
        req = lease_pb2.ListLeasesRequest(engine_id="evil")
        calm_req = lease_pb2.ListLeasesRequest(engine_id="dec")
        try:
            async def hammer() -> int:
                refused = 0
                for _ in range(80):
                    try:
                        await flood.lease.List(req, timeout=3)
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                        refused += 1
                return refused

            async def keepalive_flood() -> None:
                async def batches():
                    for i in range(200):
                        yield lease_pb2.KeepAliveRequest(seq=i, renewals=[lease_pb2.RenewRequest(conversation_id="x")])
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in flood.lease.KeepAlive(batches()):
                        pass
                # (The client may report its own failed send instead of the server's status.)
                assert err.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL)

            async def steady() -> list[grpc.StatusCode]:
                codes = []
                for _ in range(8):
                    try:
                        await calm.lease.List(calm_req, timeout=3)
                        codes.append(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as exc:
                        codes.append(exc.code())
                    await asyncio.sleep(0.1)
                return codes

            refused, _, codes = await asyncio.gather(hammer(), keepalive_flood() if not tokens else asyncio.sleep(0),
                                                     steady())
            assert refused > 0 and cp.guard.refused["rate_limited"] >= refused, "the flooder was limited"
            assert codes == [grpc.StatusCode.OK] * 8, (tokens, codes)
        finally:
            await flood.close()
            await calm.close()
            await cp.stop()


async def test_a_dead_holders_conversation_may_be_taken_over(rig):
    """A decode that died (its registration gone) while its lease lives on — an agent keeps
    renewing it — does not keep every other decode from retaining the conversation; a
    live holder still does (above)."""
    cp, c = rig
    await c["dec"].registrar.RegisterRetained(registrar_pb2.RegisterRetainedRequest(retained=registrar_pb2.RetainedBlocks(
        conversation_id="conv-dead", engine_id="dec", block_ids=[1, 2], num_tokens=32, tokens_per_block=16)), timeout=3)
    lease = (await c["dec"].lease.Grant(lease_pb2.GrantRequest(conversation_id="conv-dead", engine_id="dec",
                                                               ttl_ms=60_000), timeout=3)).lease
    retain = registrar_pb2.RegisterRetainedRequest(retained=registrar_pb2.RetainedBlocks(
        conversation_id="conv-dead", engine_id="evil", block_ids=[9], num_tokens=16, tokens_per_block=16))
    await _refused(c["evil"].registrar.RegisterRetained(retain, timeout=3))  # the holder lives
    await c["dec"].registrar.DeregisterEngine(registrar_pb2.DeregisterEngineRequest(engine_id="dec"), timeout=3)
    got = await c["router"].lease.Get(lease_pb2.GetLeaseRequest(conversation_id="conv-dead"), timeout=3)
    assert got.lease_id == lease.lease_id and got.state == lease_pb2.LEASE_STATE_ACTIVE  # still live
    await c["evil"].registrar.RegisterRetained(retain, timeout=3)
    taken = (await c["evil"].lease.Grant(lease_pb2.GrantRequest(conversation_id="conv-dead", engine_id="evil",
                                                                ttl_ms=60_000), timeout=3)).lease
    assert taken.engine_id == "evil" and taken.lease_id != lease.lease_id
    ret = await c["router"].registrar.LookupRetained(registrar_pb2.LookupRetainedRequest(conversation_id="conv-dead"),
                                                     timeout=3)
    assert ret.retained.engine_id == "evil"
