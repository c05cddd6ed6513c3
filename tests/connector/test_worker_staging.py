"""Worker plumbing of the pack path: strategy per transfer, settings, published pool."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvbaton.connector.flows.peers import engine_of_agent, staging_from_rank
from kvbaton.connector.flows.sequence import pick_strategy
from kvbaton.connector.flows.staged import STAGED_PREFIX
from kvbaton.connector.metadata import KvbatonSettings
from kvbaton.connector.transfer import staging


def _cfg(**extra: Any) -> Any:
    conf = {"control_plane": "127.0.0.1:1", "engine_id": "e0", **extra}
    return SimpleNamespace(engine_id="", get_from_extra_config=lambda k, d=None: conf.get(k, d))


def test_prefix_matches_staging_protocol() -> None:
    assert STAGED_PREFIX == staging.PREFIX


def test_settings_parse_and_defaults() -> None:
    s = KvbatonSettings.from_vllm(_cfg())
    assert s.staging == "auto"  # the default: the receiver grants slots, any number of senders
    assert KvbatonSettings.from_vllm(_cfg(staging="auto")).staging == "auto"
    host, gpu = staging.default_pool("cpu"), staging.default_pool("cuda")
    assert s.staging_pool("cpu") == (host.slot_bytes, host.slots, host.send_slots, host.target_chunks)
    assert s.staging_pool("cuda") == (gpu.slot_bytes, gpu.slots, gpu.send_slots, gpu.target_chunks)
    assert gpu.total_bytes <= 256 << 20 and host.total_bytes <= 16 << 20  # documented memory cost
    s = KvbatonSettings.from_vllm(_cfg(staging="ALWAYS", staging_slot_bytes=262144, staging_slots=2,
                                       staging_send_slots=3, staging_target_chunks=5))
    assert (s.staging, s.staging_pool("cpu"), s.staging_pool("cuda")) == \
        ("always", (262144, 2, 3, 5), (262144, 2, 3, 5))
    assert KvbatonSettings.from_vllm(_cfg(staging="never")).staging == "never"
    with pytest.raises(ValueError, match="staging"):
        KvbatonSettings.from_vllm(_cfg(staging="sometimes"))


@pytest.mark.parametrize("setting", ["auto", "always", "never"])
def test_pick_strategy_needs_both_pools(setting: str) -> None:
    for local, remote in ((False, True), (True, False), (False, False)):
        assert pick_strategy(setting, 10_000, 1 << 30, device="cuda", local_pool=local, remote_pool=remote) == "runs"
    assert pick_strategy(setting, 4, 0, device="cpu", local_pool=True, remote_pool=True) == "runs"


def test_pick_strategy_modes() -> None:
    both = {"local_pool": True, "remote_pool": True}
    # vLLM's CPU blocks (128 KiB per layer): auto keeps runs even when fully fragmented
    assert pick_strategy("auto", 2 * 64, 64 * 2 * 131072, device="cpu", **both) == "runs"
    assert pick_strategy("always", 2, 2 * 131072, device="cpu", **both) == "pack"
    assert pick_strategy("never", 100_000, 1 << 32, device="cuda", **both) == "runs"
    # GPU, fragmented 32 KiB blocks (the benchmark's shape): auto packs; contiguous: runs
    assert pick_strategy("auto", 131072, 131072 * 32768, device="cuda", **both) == "pack"
    assert pick_strategy("auto", 128, 128 * (32 << 20), device="cuda", **both) == "runs"
    # same answer as the policy it delegates to
    for n, b in ((8, 8 * 2048), (5000, 5000 * 2048), (64, 64 << 20)):
        for dev in ("cpu", "cuda"):
            assert pick_strategy("auto", n, b, device=dev, **both) == staging.choose_strategy(n, b, device=dev)


def test_engine_of_agent_inverts_agent_name() -> None:
    from kvbaton.connector.flows.peers import agent_name

    for eid in ("p0", "d-1", "a-r-b", "x-r", "engine-r7x"):
        assert engine_of_agent(agent_name(eid, 0)) == eid
        assert engine_of_agent(agent_name(eid, 12)) == eid


def test_staging_travels_in_the_rank() -> None:
    from kvbaton.v1 import common_pb2, registrar_pb2

    rank = registrar_pb2.EngineRank(engine_id="d0")
    assert staging_from_rank(rank) is None  # an engine without a pool (or an older one): runs
    rank.staging.CopyFrom(common_pb2.KvStaging(base_addr=1 << 40, slot_bytes=4096, num_slots=3,
                                               mem_type="VRAM", device_id=1))
    back = registrar_pb2.EngineRank.FromString(rank.SerializeToString())
    assert staging_from_rank(back) == staging.StagingInfo(1 << 40, 4096, 3, "VRAM", 1)
    back.staging.num_slots = 0
    assert staging_from_rank(back) is None


def test_push_xfer_id_is_stable_and_valid() -> None:
    from kvbaton.connector.flows.sequence import push_xfer_id

    assert push_xfer_id("abc123") == push_xfer_id("abc123") == "wabc123"
    odd = push_xfer_id("a b")
    assert odd.startswith("w") and not any(c.isspace() for c in odd)
