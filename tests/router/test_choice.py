"""The router's engine choice (``services/router/choice.py``): pure rules, no engines."""

from __future__ import annotations

import pytest

from kvbaton.services.router.choice import (
    ROLE_BOTH,
    ROLE_DECODE,
    ROLE_PREFILL,
    DecodeReason,
    Fleet,
    PrefillHint,
    PrefillReason,
    estimate_prompt_tokens,
)


def _fleet(n_p: int = 2, n_d: int = 2, slack: int = 2) -> Fleet:
    f = Fleet(slack=slack, suspect_s=5.0, discovering=True)
    for i in range(n_p):
        f.put_rank(f"p{i}", 0, 1, ROLE_PREFILL, f"http://p{i}", False)
    for i in range(n_d):
        f.put_rank(f"d{i}", 0, 1, ROLE_DECODE, f"http://d{i}", False)
    return f


def test_prefill_goes_to_least_outstanding_tokens_not_requests():
    f = _fleet()
    f.start_prefill(f.engines["p0"], 8000)  # one long prompt
    for _ in range(5):
        f.start_prefill(f.engines["p1"], 100)  # five short ones: less work
    assert f.choose(0.0).prefill.engine_id == "p1"
    f.end_prefill(f.engines["p0"], 8000)
    assert f.choose(0.0).prefill.engine_id == "p0"


def test_idle_fleet_alternates():
    f = _fleet()
    picks = [(c.prefill.engine_id, c.decode.engine_id) for c in (f.choose(0.0) for _ in range(4))]
    assert [p for p, _ in picks] == ["p0", "p1", "p0", "p1"]
    assert [d for _, d in picks] == ["d0", "d1", "d0", "d1"]


def test_decode_affinity_within_slack_then_least_loaded():
    f = _fleet(slack=2)
    for _ in range(2):
        f.start_decode(f.engines["d1"])
    c = f.choose(0.0, holder_id="d1")
    assert (c.decode.engine_id, c.reason) == ("d1", DecodeReason.AFFINITY)  # 2 <= 0 + 2
    f.start_decode(f.engines["d1"])
    c = f.choose(0.0, holder_id="d1")
    assert (c.decode.engine_id, c.reason) == ("d0", DecodeReason.HOLDER_OVERLOADED)
    c = f.choose(0.0)
    assert (c.decode.engine_id, c.reason) == ("d0", DecodeReason.NO_HISTORY)


def test_holder_gone_draining_suspect_or_excluded_is_not_chosen():
    f = _fleet()
    assert f.choose(0.0, holder_id="d9").reason is DecodeReason.HOLDER_UNAVAILABLE
    f.put_rank("d1", 0, 1, ROLE_DECODE, "http://d1", True)  # draining
    c = f.choose(0.0, holder_id="d1")
    assert (c.decode.engine_id, c.reason) == ("d0", DecodeReason.HOLDER_UNAVAILABLE)
    assert not f.holder_usable("d1", 0.0)
    f.put_rank("d1", 0, 1, ROLE_DECODE, "http://d1", False)
    f.mark_suspect("d1", now=10.0)
    assert f.choose(12.0, holder_id="d1").decode.engine_id == "d0"
    f.mark_suspect("d0", now=10.0)  # every decode suspect: try one rather than fail
    assert f.choose(12.0).decode is not None
    f.engines["d0"].suspect_until = 0.0
    assert f.choose(15.5, holder_id="d1").decode.engine_id == "d1"  # suspicion lapses
    assert f.choose(20.0, holder_id="d1", exclude={"d1"}).decode.engine_id == "d0"
    assert f.choose(20.0, exclude={"p0", "p1"}).prefill is None


def test_registration_ending_removes_engine_and_tp_engines_need_every_rank():
    f = _fleet()
    f.delete_rank("d1", 0)
    assert "d1" not in f.engines and not f.holder_usable("d1", 0.0)
    f.put_rank("d7", 0, 2, ROLE_DECODE, "http://d7", False)
    assert "d7" not in {e.engine_id for e in f.routable(ROLE_DECODE, 0.0)}
    f.put_rank("d7", 1, 2, ROLE_DECODE, "", False)
    assert "d7" in {e.engine_id for e in f.routable(ROLE_DECODE, 0.0)}
    # An engine that leaves with requests on it stays (for accounting) but gets nothing new.
    f.start_decode(f.engines["d0"])
    f.delete_rank("d0", 0)
    assert "d0" in f.engines and "d0" not in {e.engine_id for e in f.routable(ROLE_DECODE, 0.0)}
    f.end_decode(f.engines["d0"])
    assert "d0" not in f.engines
    f.forget_missing({"p0"})
    assert set(f.engines) == {"p0"}


def test_static_engines_survive_discovery_and_both_roles():
    f = Fleet()
    f.add_static("a", "http://a/", ROLE_PREFILL)
    f.add_static("a", "http://a", ROLE_DECODE)
    assert f.engines["a"].role == ROLE_BOTH and f.engines["a"].url == "http://a"
    f.forget_missing(set())
    c = f.choose(0.0)
    assert c.prefill.engine_id == c.decode.engine_id == "a"
    assert f.holder_usable("unknown", 0.0)  # a static fleet cannot tell: let prefill try
    with pytest.raises(ValueError):
        Fleet(slack=-1)


@pytest.mark.parametrize("body,tokens", [
    ({"prompt": [1, 2, 3]}, 3),
    ({"prompt": "x" * 400}, 100),
    ({"messages": [{"role": "user", "content": "y" * 80}, {"content": [{"type": "text", "text": "z" * 40}]}]}, 30),
    ({}, 1),
])
def test_prompt_token_estimate(body, tokens):
    assert estimate_prompt_tokens(body) == tokens


async def test_discovery_relists_after_a_broken_watch_and_forgets_engines_gone_meanwhile():
    """``follow_registrar`` over a stand-in client: the first watch breaks (UNAVAILABLE),
    the second listing no longer has d1 (it died while the stream was down)."""
    import asyncio

    import grpc

    from kvbaton.services.router.discovery import follow_registrar
    from kvbaton.v1 import common_pb2, registrar_pb2

    def rank(eid, role, url):
        return registrar_pb2.EngineRank(engine_id=eid, role=role, tp_size=1, serve_url=url)

    listings = [[rank("p0", common_pb2.ENGINE_ROLE_PREFILL, "http://p0"), rank("d1", common_pb2.ENGINE_ROLE_DECODE, "http://d1")],
                [rank("p0", common_pb2.ENGINE_ROLE_PREFILL, "http://p0")]]
    second_watch = asyncio.Event()

    class Watch:
        def __init__(self, n):
            self.n = n

        def __aiter__(self):
            return self

        async def __anext__(self):
            if self.n == 0:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down")
            second_watch.set()
            await asyncio.Event().wait()

        def cancel(self):
            pass

    class Kv:
        addresses = ["a"]

        def __init__(self):
            self.registrar = self
            self.lists = 0
            self.watches = 0

        async def list_engines_at(self):
            self.lists += 1
            return listings[min(self.lists - 1, 1)], 0, ""

        def WatchEngines(self, req):
            self.watches += 1
            return Watch(self.watches - 1)

    fleet = Fleet(discovering=True)
    ready = asyncio.Event()
    seen: list[set[str]] = []
    task = asyncio.ensure_future(follow_registrar(Kv(), fleet, ready=ready, max_backoff_s=0.05,
                                                  on_change=lambda: seen.append(set(fleet.engines))))
    await asyncio.wait_for(ready.wait(), 5)
    await asyncio.wait_for(second_watch.wait(), 5)
    assert seen[0] == {"p0", "d1"}  # first listing
    assert set(fleet.engines) == {"p0"} and not fleet.holder_usable("d1", 0.0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_conversation_stays_on_the_prefill_holding_its_history_while_that_saves_work():
    f = _fleet()
    hint = PrefillHint("p1", cached_tokens=5000)
    # Idle fleet: the prefill that served the last turn (only 1000 new tokens to compute).
    c = f.choose(0.0, hint=hint, prompt_tokens=6000)
    assert (c.prefill.engine_id, c.prefill_reason) == ("p1", PrefillReason.CACHED)
    # Busy with less than the 5000 tokens the stay saves: still p1.
    f.start_prefill(f.engines["p1"], 4000)
    assert f.choose(0.0, hint=hint, prompt_tokens=6000).prefill.engine_id == "p1"
    # Busier than that: recomputing the history elsewhere is quicker.
    f.start_prefill(f.engines["p1"], 2000)
    c = f.choose(0.0, hint=hint, prompt_tokens=6000)
    assert (c.prefill.engine_id, c.prefill_reason) == ("p0", PrefillReason.LEAST_WORK)


def test_history_readable_from_decode_makes_the_other_prefill_cheap():
    f = _fleet()
    hint = PrefillHint("p1", cached_tokens=5000)
    f.start_prefill(f.engines["p1"], 1000)
    # Without retained KV the stay saves 5000 tokens: p1 despite its queue.
    assert f.choose(0.0, hint=hint, prompt_tokens=6000).prefill.engine_id == "p1"
    # Decode retains the history: p0 READs it (cost 0.1 a token) instead of waiting.
    c = f.choose(0.0, hint=hint, prompt_tokens=6000, reuse_tokens=5000)
    assert (c.prefill.engine_id, c.prefill_reason) == ("p0", PrefillReason.LEAST_WORK)
    # Equal otherwise, the prefill holding the history wins the tie (no READ at all).
    f.end_prefill(f.engines["p1"], 1000)
    assert f.choose(0.0, hint=hint, prompt_tokens=6000, reuse_tokens=5000).prefill.engine_id == "p1"


def test_a_hint_for_an_engine_gone_or_excluded_is_ignored():
    f = _fleet()
    c = f.choose(0.0, hint=PrefillHint("p9", 5000), prompt_tokens=6000)
    assert c.prefill is not None and c.prefill_reason is PrefillReason.LEAST_WORK
    c = f.choose(0.0, exclude={"p1"}, hint=PrefillHint("p1", 5000), prompt_tokens=6000)
    assert c.prefill.engine_id == "p0"


def test_engines_own_counts_show_other_routers_work_while_fresh():
    f = _fleet(slack=1)
    f.start_decode(f.engines["d1"])  # this router: d0 idle, d1 one request
    f.report_load("d0", 3, now=0.0, ttl_s=2.0)  # d0 says 3 running + waiting: another router's
    assert f.choose(1.0).decode.engine_id == "d1"  # 1 < 3
    c = f.choose(1.0, holder_id="d0")
    assert (c.decode.engine_id, c.reason) == ("d1", DecodeReason.HOLDER_OVERLOADED)  # 3 > 1 + 1
    f.report_load("d1", 0, now=0.0, ttl_s=2.0)  # a report lagging this router's own count
    assert f.engines["d1"].decode_load(1.0) == 1
    assert f.choose(2.5).decode.engine_id == "d0"  # reports stale: own counts only (0 < 1)
    # Prefill: another router's requests weigh a typical prompt each.
    for _ in range(4):
        f.start_prefill(f.engines["p1"], 1000)
        f.end_prefill(f.engines["p1"], 1000)
    f.start_prefill(f.engines["p1"], 500)
    f.report_load("p0", 2, now=0.0, ttl_s=2.0)
    assert f.engines["p0"].prefill_load(1.0, f.typical_prompt_tokens) > 1500
    assert f.choose(1.0, prompt_tokens=100).prefill.engine_id == "p1"
    assert f.choose(3.0, prompt_tokens=100).prefill.engine_id == "p0"
    snap = {e["engine_id"]: e for e in f.snapshot(1.0)}
    assert snap["p0"]["reported_requests"] == 2 and snap["p1"]["reported_requests"] is None


def test_engine_request_counts_from_metrics_text():
    from kvbaton.services.router.engine_load import engine_requests

    text = ('# HELP vllm:num_requests_running x\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\n'
            'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 4.0\n')
    assert engine_requests(text) == 7
    assert engine_requests("process_cpu_seconds_total 3.0\n") is None
