"""Scheduler-half bookkeeping of the kvbaton connector, without an engine.

These pin the contracts from connector/VLLM_API_NOTES.md that a wrong implementation
violates silently: offer a remote load once (§0.5), never load into locally prefix-cached
blocks (§0.6), hold blocks only for finished P requests (§7).
"""

from __future__ import annotations

import asyncio
import dataclasses
import types

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus

from kvbaton.connector.metadata import KvbatonSettings
from kvbaton.connector.scheduler import KvbatonScheduler

BS = 128


def _req(rid: str, n_prompt: int, params: dict | None, status=RequestStatus.WAITING, computed: int = 0):
    return types.SimpleNamespace(request_id=rid, prompt_token_ids=list(range(n_prompt)),
                                 num_prompt_tokens=n_prompt, kv_transfer_params=params,
                                 status=status, num_computed_tokens=computed)


def _blocks(ids: list[int]):
    return types.SimpleNamespace(get_block_ids=lambda: (list(ids),))


@pytest.fixture
def sched() -> KvbatonScheduler:
    return KvbatonScheduler(KvbatonSettings(control_plane="127.0.0.1:1", engine_id="d0"), BS)


def test_decode_offers_once_and_skips_cached_blocks(sched: KvbatonScheduler) -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [7, 8, 9],
              "remote_num_tokens": 300, "transfer_id": "t1"}
    r = _req("r1", 300, params)
    assert sched.get_num_new_matched_tokens(r, 128) == (172, True)
    sched.update_state_after_alloc(r, _blocks([4, 5, 6]), 172)
    meta = sched.build_connector_meta(None)
    spec = meta.loads["r1"]
    assert spec.local_block_ids == (5, 6) and spec.remote_block_ids == (8, 9)
    assert spec.remote_engine_id == "p0" and spec.transfer_id == "t1"
    # After a failed load the request is re-admitted: it must not be offered again.
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert sched.build_connector_meta(None).loads == {}


def test_prefill_holds_blocks_and_returns_params(sched: KvbatonScheduler) -> None:
    r = _req("p1", 200, {"do_remote_decode": True, "transfer_id": "t2"},
             status=RequestStatus.FINISHED_LENGTH_CAPPED, computed=200)
    hold, out = sched.request_finished(r, [3, 4])
    assert hold and out is not None
    assert out["do_remote_prefill"] and out["remote_block_ids"] == [3, 4]
    assert out["remote_engine_id"] == "d0" and out["transfer_id"] == "t2"
    assert sched.build_connector_meta(None).sends["p1"].transfer_id == "t2"


def test_aborted_prefill_and_plain_requests_free_at_once(sched: KvbatonScheduler) -> None:
    aborted = _req("p2", 200, {"do_remote_decode": True}, status=RequestStatus.FINISHED_ABORTED)
    assert sched.request_finished(aborted, [3, 4]) == (False, None)
    plain = _req("x", 10, None, status=RequestStatus.FINISHED_STOPPED)
    assert sched.request_finished(plain, [1]) == (False, None)
    assert sched.get_num_new_matched_tokens(plain, 0) == (0, False)


def test_decode_aborted_before_alloc_releases_prefill(sched: KvbatonScheduler) -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [7],
              "transfer_id": "t3"}
    r = _req("r3", 50, params, status=RequestStatus.FINISHED_ABORTED)
    assert sched.request_finished(r, []) == (False, None)
    spec = sched.build_connector_meta(None).loads["r3"]
    assert spec.local_block_ids == () and not spec.report_recv and spec.transfer_id == "t3"


def _out(tokens: int):
    return types.SimpleNamespace(total_num_scheduled_tokens=tokens)


def test_idle_step_sleeps_only_while_own_transfers_pend() -> None:
    s = KvbatonScheduler(KvbatonSettings(control_plane="127.0.0.1:1", engine_id="p0", idle_step_wait_ms=20), BS)
    s.build_connector_meta(_out(0))  # nothing of ours pending: vLLM's own empty step, no sleep
    assert s.idle_stats["idle_steps"] == 0
    r = _req("p1", 200, {"do_remote_decode": True, "transfer_id": "t2"},
             status=RequestStatus.FINISHED_LENGTH_CAPPED, computed=200)
    assert s.request_finished(r, [3, 4])[0]
    s.build_connector_meta(_out(0))  # the step that hands the send to the worker: no sleep
    assert s.idle_stats["idle_steps"] == 0
    s.build_connector_meta(_out(5))  # something scheduled: never sleep
    assert s.idle_stats["idle_steps"] == 0
    s.build_connector_meta(_out(0))  # empty step while our hold pends: sleep
    assert s.idle_stats["idle_steps"] == 1 and s.idle_stats["idle_wait_s"] >= 0.015
    s.update_connector_output({"p1"}, None)  # worker reports the send done
    s.build_connector_meta(_out(0))
    assert s.idle_stats["idle_steps"] == 1


def test_idle_wait_disabled_and_stale_entries_dropped() -> None:
    s = KvbatonScheduler(KvbatonSettings(control_plane="127.0.0.1:1", engine_id="p0", idle_step_wait_ms=0), BS)
    s._in_flight["x"] = 0.0
    s.build_connector_meta(_out(0))
    assert s.idle_stats["idle_steps"] == 0
    s.settings = dataclasses.replace(s.settings, idle_step_wait_ms=5)
    s.build_connector_meta(_out(0))  # "x" is past its deadline: forgotten, no sleep
    assert s.idle_stats["idle_steps"] == 0 and not s._in_flight


def test_push_complete_from_worker_moves_the_rpc_to_the_send_spec() -> None:
    for here in (False, True):
        s = KvbatonScheduler(KvbatonSettings(control_plane="127.0.0.1:1", engine_id="p0",
                                             complete_from_worker=here), BS)
        sent: list[str] = []
        s._rpc = lambda what, fn, tid="", sent=sent: sent.append(what)  # type: ignore[method-assign]
        r = _req("p9", 300, {"do_remote_decode": True, "transfer_id": "t9", "transfer_mode": "push"},
                 status=RequestStatus.FINISHED_LENGTH_CAPPED, computed=300)
        hold, out = s.request_finished(r, [3, 4, 5])
        assert hold and out["transfer_mode"] == "push"
        spec = s.build_connector_meta(None).sends["p9"]
        assert spec.complete_here is here and spec.request_id == "p9" and spec.block_ids == (3, 4, 5)
        assert sent == ([] if here else ["Complete"])


def test_params_of_another_version_are_refused_and_the_request_computed_here(sched: KvbatonScheduler) -> None:
    r = _req("v1", 300, {"kvbaton_params_version": 2, "do_remote_prefill": True, "remote_engine_id": "p0",
                         "remote_block_ids": [7, 8, 9], "remote_num_tokens": 300, "transfer_id": "t1"})
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert r.kv_transfer_params is None and sched.params_refused == 1
    assert sched.request_finished(r, [1, 2]) == (False, None)
    assert sched.build_connector_meta(None).loads == {}
    ok = _req("v2", 300, {"kvbaton_params_version": 1, "do_remote_prefill": True, "remote_engine_id": "p0",
                          "remote_block_ids": [7, 8, 9], "remote_num_tokens": 300, "transfer_id": "t2"})
    assert sched.get_num_new_matched_tokens(ok, 0) == (300, True) and sched.params_refused == 1


def test_push_messages_carry_the_engines_the_router_named() -> None:
    """Prefill's Complete names the decode, decode's Offer names the prefill (from
    kv_transfer_params), so the control plane binds the transfer to the pair; the worker's
    Complete (complete_from_worker) gets the name through the SendSpec."""
    sent: list[object] = []
    async def record(req: object, *_a: object, **_kw: object) -> None:
        sent.append(req)
    fake = types.SimpleNamespace(rendezvous=types.SimpleNamespace(Complete="Complete", Offer="Offer", Cancel="Cancel"),
                                 call=lambda method, req, **kw: record(req),
                                 session=types.SimpleNamespace(  # untraced calls go over the session
                                     complete=record, offer=record, cancel=record))
    p = KvbatonScheduler(KvbatonSettings(control_plane="127.0.0.1:1", engine_id="p0"), BS)
    p._rpc = lambda what, fn, tid="": asyncio.run(fn(fake))  # type: ignore[method-assign]
    r = _req("p1", 300, {"do_remote_decode": True, "transfer_id": "t1", "transfer_mode": "push",
                         "decode_engine_id": "d0"}, status=RequestStatus.FINISHED_LENGTH_CAPPED, computed=300)
    p.request_finished(r, [3, 4, 5])
    assert sent[-1].prefill_engine_id == "p0" and sent[-1].decode_engine_id == "d0"
    assert p.build_connector_meta(None).sends["p1"].peer_engine_id == "d0"
    d = KvbatonScheduler(KvbatonSettings(control_plane="127.0.0.1:1", engine_id="d0"), BS)
    d._rpc = lambda what, fn, tid="": asyncio.run(fn(fake))  # type: ignore[method-assign]
    r = _req("d1", 300, {"do_remote_prefill": True, "transfer_id": "t1", "transfer_mode": "push",
                         "prefill_engine_id": "p0"})
    n, _ = d.get_num_new_matched_tokens(r, 0)
    d.update_state_after_alloc(r, _blocks([7, 8, 9]), n)
    assert sent[-1].decode_engine_id == "d0" and sent[-1].prefill_engine_id == "p0"


def test_admitted_line_says_when_each_leg_left_the_queue_and_what_it_loads(tmp_path) -> None:
    """The TTFT breakdown's stamps (benchmarks/ttft_breakdown.py): one ``admitted`` line per
    P/D leg, with vLLM's arrival time, the local hit and the tokens loaded from elsewhere."""
    import json

    s = KvbatonScheduler(KvbatonSettings(control_plane="127.0.0.1:1", engine_id="d0", stats_dir=str(tmp_path)), BS)
    params = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [7, 8, 9],
              "remote_num_tokens": 300, "transfer_id": "t1", "conversation_id": "c1"}
    r = _req("r1", 300, params)
    r.arrival_time = 123.5
    assert s.get_num_new_matched_tokens(r, 256) == (44, True)
    s.update_state_after_alloc(r, _blocks([4, 5, 6]), 44)
    p = _req("p1", 200, {"do_remote_decode": True, "transfer_id": "t2"})
    s.update_state_after_alloc(p, _blocks([1, 2]), 0)
    s.update_state_after_alloc(_req("x", 10, {"conversation_id": "c"}), _blocks([3]), 0)  # not a P/D leg
    lines = [json.loads(x) for x in (tmp_path / "d0.scheduler.jsonl").read_text().splitlines()]
    got = [x for x in lines if x["event"] == "admitted"]
    assert [(x["role"], x["transfer_id"]) for x in got] == [("decode", "t1"), ("prefill", "t2")]
    d, pf = got
    assert d["arrival_t"] == 123.5 and d["local_hit_tokens"] == 256 and d["external_tokens"] == 44
    assert d["conversation_id"] == "c1" and d["prompt_tokens"] == 300 and d["t"] >= d["arrival_t"]
    assert pf["local_hit_tokens"] == -1 and pf["external_tokens"] == 0
