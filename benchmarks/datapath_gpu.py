"""Data-path benchmark on CUDA tensors: NIXL WRITE/READ of a KV cache between GPUs.

For 1k/4k/16k tokens of a Qwen3-32B-shaped cache (64 layers, 8 KV heads × 128, bf16,
16-token blocks: 32 KiB per layer-K/V block), source on ``cuda:0`` and destination on
``cuda:1`` when two GPUs are visible (else both on ``cuda:0``), contiguous and fragmented
(random permutation) block ids, WRITE and READ, it times

* ``pack@<pool>`` — the connector's staged path (:class:`StagedPeer`, the worker's
  own transfer path): slots granted by the receiver, one gather kernel per chunk into a
  registered slot, one NIXL WRITE per chunk, one scatter kernel per chunk on the
  receiver, pipelined (a staged READ is a pull request answered by a staged WRITE).
  ``pack@shipped`` uses the pools an engine allocates by default
  (:func:`staging.default_pool`), ``pack@2GiB`` the same path with 2 GiB (8 shared slots of 256 MiB); the
  table gives each one's staging memory per engine;
* ``runs``      — one NIXL descriptor per coalesced run (per region);
* ``per_block`` — one NIXL descriptor per block (per region);
* ``plain_copy``— a raw peer copy ``dst.copy_(src)`` of the same bytes;

plus two senders packing into one receiver at the same time (WRITE: both push; READ: the
receiver pulls from both), GB/s each, a sweep of pool shapes within 256 MiB per engine,
a per-chunk trace of where a staged transfer's time goes, and, on one GPU, the
gather/scatter kernels alone (Triton one-launch vs torch per region). Every transfer is
verified: per-region order-sensitive checksums of the
destination blocks must equal those of the source blocks (destination zeroed before).
``policy`` is what :func:`choose_strategy` picks for the case (the connector's path).

    python benchmarks/datapath_gpu.py                    # 1k, 4k, 16k tokens
    python benchmarks/datapath_gpu.py --smoke            # tiny, seconds
    python benchmarks/datapath_gpu.py --tokens 16384 --iters 5 --out /tmp/x.json

Needs torch, numpy, triton and nixl (``nixl`` + ``nixl-cu13`` wheels), and kvbaton installed
(``pip install --no-deps -e .``: the connector is ``kvbaton.connector``). Exits 0 with
"skipped: no CUDA" where there is no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch  # torch before nixl: it must own the CUDA context first

import datapath  # this directory, put on sys.path above
from kvbaton.connector.transfer.descriptors import coalesce_runs, plan_transfer
from kvbaton.connector.transfer.geometry import KvLayout
from kvbaton.connector.transfer.nixl_agent import NixlEndpoint
from kvbaton.connector.transfer.staging import (
    PREFIX,
    GpuRowCopier,
    PoolDefaults,
    StagedPeer,
    choose_strategy,
    default_pool,
    pack_blocks,
    plan_tiles,
    region_byte_views,
    unpack_blocks,
)

GB = 1e9


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=5, help="measured runs per case (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--per-block-iters", type=int, default=2,
                   help="measured runs of the (slow) per-block case, no warm-up")
    p.add_argument("--strategies", default="runs,pack,per_block")
    p.add_argument("--ops", default="WRITE,READ")
    p.add_argument("--patterns", default="contiguous,fragmented")
    p.add_argument("--pools", default="shipped,2GiB",
                   help="staged pools measured at every size: shipped, 2GiB, or "
                        "SLOTMiBxRECVxSENDxCHUNKS (e.g. 32x4x4x16)")
    p.add_argument("--sweep-pools", default="",
                   help="more pool shapes, fragmented only, every size (same syntax)")
    p.add_argument("--two-senders", default="shipped",
                   help="pool for the two-senders case (empty: skip)")
    p.add_argument("--trace", default="shipped,2GiB",
                   help="pools traced chunk by chunk (one fragmented WRITE, largest size)")
    p.add_argument("--profile", default="",
                   help="pools whose one fragmented WRITE (largest size) runs under cProfile on both "
                        "sides (text files next to --out)")
    p.add_argument("--nospin", action="store_true",
                   help="also measure the shipped pool with spin off (sleep backoff polling)")
    p.add_argument("--cpu", action="store_true",
                   help="host memory instead of GPUs (a logic smoke test of this script)")
    p.add_argument("--commit", default="", help="git commit measured (recorded in the results)")
    p.add_argument("--label", default="", help="how the GPU was shared (e.g. under CUDA MPS), in the title")
    p.add_argument("--no-kernel", action="store_true", help="torch gathers instead of Triton")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one iteration")
    p.add_argument("--out", default=str(datapath.REPO / "benchmarks/results/datapath_gpu.json"))
    p.add_argument("--md", default=None, help="markdown table path (default: --out with .md)")
    a = p.parse_args(argv)
    if a.smoke:
        a.tokens, a.layers, a.iters, a.warmup, a.per_block_iters = [256, 1024], 4, 1, 1, 1
    return a


def sync(*devs: torch.device) -> None:
    for d in devs:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


class CaseError(RuntimeError):
    """A case that NIXL refused (reported in the results, the suite goes on)."""


class Checksummer:
    """Per-region, order-sensitive checksums of selected blocks, computed on their GPU."""

    def __init__(self) -> None:
        self._w: dict[tuple[int, torch.device], torch.Tensor] = {}

    def __call__(self, views: Sequence[torch.Tensor], ids: np.ndarray) -> torch.Tensor:
        dev = views[0].device
        idx = torch.from_numpy(ids).to(dev)
        n = int(ids.shape[0])
        out = torch.empty(len(views), dtype=torch.int64, device=dev)
        for r, v in enumerate(views):
            x = v.index_select(0, idx).view(torch.int32).view(n, -1)
            key = (x.shape[1], dev)
            if key not in self._w:
                self._w[key] = (torch.arange(x.shape[1], device=dev, dtype=torch.int64)
                                * 2654435761 % 1000003 + 1)
            rows = (x.to(torch.int64) * self._w[key]).sum(1)
            pos = torch.arange(1, n + 1, device=dev, dtype=torch.int64) * 40503
            out[r] = (rows * pos).sum()
        return out.cpu()


def enable_peer_access() -> None:
    """Let this process's GPUs reach each other (torch enables peer access on the first
    cross-device copy). UCX's CUDA IPC copies between an opened peer handle and local
    memory fail with 'invalid argument' in a process where it is off."""
    n = torch.cuda.device_count()
    for i in range(n):
        for j in range(n):
            if i != j and torch.cuda.can_device_access_peer(i, j):
                torch.ones(1, device=f"cuda:{i}").to(f"cuda:{j}")
    torch.cuda.synchronize()


MiB = 1 << 20
# the reference: the same path (one pool shared by both directions, as shipped) with 2 GiB
REF_POOL = PoolDefaults(slot_bytes=256 * MiB, slots=4, send_slots=4, target_chunks=16, shared=True)


#: variants of a pool, as name suffixes: the same pools, one protocol setting changed
VARIANTS = {"-nospin": "sleep-backoff polling",
            "-noahead": "gather only once a receive slot is idle (before gather-ahead)",
            "-k1": "one Triton launch per chunk whatever its regions",
            "-nomerge": "one torch gather/scatter launch per region (before K/V merging)"}


def base_pool(name: str) -> tuple[str, str]:
    """``(pool, variant suffix or "")`` of a pool name such as ``shipped-noahead``."""
    for suf in VARIANTS:
        if name.endswith(suf):
            return name.removesuffix(suf), suf
    return name, ""


def pool_by_name(name: str) -> PoolDefaults:
    """``shipped`` (what an engine allocates by default), ``2GiB`` (the reference), or
    ``SLOTMiBxRECVxSENDxCHUNKS`` (optionally with a :data:`VARIANTS` suffix)."""
    name = base_pool(name)[0]
    # "-split": two pools (receive, send) instead of one shared by both directions
    split = name.endswith("-split")
    name = name.removesuffix("-split")
    if name == "shipped":
        p = default_pool("cuda")
    elif name == "2GiB":
        p = REF_POOL
    else:  # SLOTxRECVxSENDxCHUNKS[s]: "s" = one shared pool
        shared = name.endswith("s")
        slot, recv, send, chunks = (int(x) for x in name.removesuffix("s").split("x"))
        p = PoolDefaults(slot_bytes=slot * MiB, slots=recv, send_slots=send, target_chunks=chunks, shared=shared)
    return dataclasses.replace(p, shared=False) if split else p


def pool_kw(pool: PoolDefaults, no_kernel: bool = False) -> dict[str, Any]:
    """StagedPeer arguments for a pool, as the worker builds them."""
    return dict(slot_bytes=pool.slot_bytes, num_slots=pool.slots, send_slots=pool.send_slots,
                target_chunks=pool.target_chunks, min_chunk_bytes=min(4 * MiB, pool.slot_bytes),
                use_kernel=False if no_kernel else None, shared=pool.shared)


def pool_label(name: str) -> str:
    p = pool_by_name(name)
    slots = (f"{p.slots + p.send_slots} shared" if p.shared else f"{p.slots}+{p.send_slots}")
    return (f"{name}: {slots} × {p.slot_bytes // MiB} MiB "
            f"= {p.total_bytes // MiB} MiB/engine, ~{p.target_chunks} chunks")


def all_pools(args: argparse.Namespace) -> list[str]:
    names = ["shipped"] + [base_pool(p)[0] for x in (args.pools, args.sweep_pools, args.two_senders, args.trace)
                           for p in x.split(",") if p]
    return list(dict.fromkeys(names))


class Pools:
    """Staged peers of one endpoint, one per pool shape, all built (and registered) before
    the endpoint's metadata goes to peers; staging notifications go to the active one (a
    router registered before any of them)."""

    def __init__(self, ep: NixlEndpoint, tensors: list[torch.Tensor], layout: KvLayout,
                 no_kernel: bool, names: list[str]) -> None:
        self.active: StagedPeer | None = None
        ep.on_notif(PREFIX, self._route)
        self.peers = {name: StagedPeer(ep, tensors, layout, **pool_kw(pool_by_name(name), no_kernel))
                      for name in names}

    def _route(self, peer: str, msg: bytes) -> None:
        assert self.active is not None
        self.active._on_notif(peer, msg)

    def use(self, name: str, spin: bool = True) -> StagedPeer:
        base, variant = base_pool(name)
        self.active = self.peers[base]
        self.active.spin = spin and self.active.cuda and variant != "-nospin"
        self.active.gather_ahead = variant != "-noahead"
        self.active.kernel_min_regions = 1 if variant == "-k1" else 4
        self.active.merge_regions = self.active.cuda and variant != "-nomerge"
        return self.active

    def close(self) -> None:
        for p in self.peers.values():
            p.close()


def _engine_main(role: str, args: argparse.Namespace, tokens: int, dev_index: int, conn: Any) -> None:
    """Another engine, in its own process (UCX refuses CUDA IPC between two agents of one
    process and would fall back to TCP): ``dst`` owns the destination cache (the receiver),
    ``src2`` a second source cache (the second sender of the two-senders case)."""
    dev = torch.device(f"cuda:{dev_index}") if dev_index >= 0 else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        enable_peer_access()
    n = tokens // args.block_size
    cache = datapath.make_cache(args, n, dev, fill_seed=None if role == "dst" else args.seed + 7)
    lay = KvLayout.from_tensors(cache, args.block_size)
    views = region_byte_views(cache, lay)
    ep = NixlEndpoint(f"gpu-{role}-{tokens}")
    ep.register_layout(lay)
    pools = Pools(ep, cache, lay, args.no_kernel, all_pools(args))
    check = Checksummer()
    conn.send((ep.name, ep.metadata(), lay.to_proto_fields()))
    peers: dict[str, KvLayout] = {}
    t_out = args.timeout

    def until(t_go: float) -> None:
        while time.perf_counter() < t_go:
            pass

    try:
        while True:
            cmd, *rest = conn.recv()
            sb = pools.active
            if cmd == "stop":
                break
            if cmd == "addpeer":
                name, meta, fields = rest
                ep.add_peer(name, meta)
                peers[name] = KvLayout.from_proto_fields(**fields)
                conn.send("ok")
            elif cmd == "pool":
                sb = pools.use(*rest)
                conn.send(sb.info())
            elif cmd == "trace":
                assert sb is not None
                old, sb.trace = sb.trace, ([] if rest[0] else None)
                gpu, sb.gpu_trace = sb.gpu_trace, []
                conn.send((old or [], gpu))
            elif cmd == "profile":  # cProfile on (True) / off (False: its top functions)
                import cProfile
                import io
                import pstats
                if rest[0]:
                    prof = cProfile.Profile()
                    prof.enable()
                    conn.send("ok")
                else:
                    prof.disable()
                    buf = io.StringIO()
                    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
                    conn.send(buf.getvalue())
            elif cmd == "clear":
                for t in cache:
                    t.zero_()
                sync(dev)
                conn.send("ok")
            elif cmd == "checksum":
                conn.send(check(views, rest[0]))
            elif cmd == "expect":  # the peer WRITEs: done when the data is in our blocks
                strategy, peer, xid = rest
                if strategy == "pack":
                    assert sb is not None
                    sb.wait_complete(xid, timeout_s=t_out)
                else:  # a WRITE's notification arrives after its data
                    ep.wait_notif(peer, xid.encode(), timeout_s=t_out)
                sync(dev)
                conn.send(time.perf_counter())
            elif cmd == "expect_all":  # several staged WRITEs at once: when each completed
                assert sb is not None
                xids, done = set(rest[0]), {}
                deadline = time.monotonic() + t_out
                while len(done) < len(xids):
                    sb.progress()
                    for x in xids - set(done):
                        if x in sb.completed:
                            sb.completed.pop(x)
                            sync(dev)
                            done[x] = time.perf_counter()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"staged WRITEs {sorted(xids - set(done))} incomplete")
                conn.send(done)
            elif cmd == "read":
                strategy, peer, sids, dids, xid = rest
                t0 = time.perf_counter()
                descs = 0
                if strategy != "pack":
                    try:
                        plan = plan_transfer(lay, dids, peers[peer], sids, op="READ",
                                             coalesce=strategy == "runs")
                        x = ep.read(plan, peer, xid.encode())
                        ep.wait(x, t_out)
                    except Exception as e:  # noqa: BLE001 - reported as the case's result
                        conn.send(("error", f"{type(e).__name__}: {e}"))
                        continue
                    descs = plan.num_descs
                else:
                    assert sb is not None
                    sb.request_pull(peer, sids, dids, xid, timeout_s=t_out)
                    sb.wait_complete(xid, timeout_s=t_out)
                sync(dev)
                conn.send(((time.perf_counter() - t0) * 1e3, descs))
            elif cmd == "pull_all":  # staged READs from several owners at once, from t_go
                assert sb is not None
                reqs, t_go = rest
                until(t_go)
                for peer, sids, dids, xid in reqs:
                    sb.request_pull(peer, sids, dids, xid, timeout_s=t_out)
                done = {}
                deadline = time.monotonic() + t_out
                while len(done) < len(reqs):
                    sb.progress()
                    for _, _, _, x in reqs:
                        if x not in done and x in sb.completed:
                            sb.completed.pop(x)
                            sync(dev)
                            done[x] = time.perf_counter()
                    if time.monotonic() > deadline:
                        raise TimeoutError("staged READs incomplete")
                conn.send(done)
            elif cmd == "send":  # second sender: a staged WRITE from t_go
                assert sb is not None
                peer, sids, dids, xid, t_go = rest
                until(t_go)
                sb.send(peer, None, sids, dids, xid, timeout_s=t_out)
                conn.send(time.perf_counter())
            elif cmd == "serve":  # second sender: answer n staged READs
                assert sb is not None
                served, deadline = 0, time.monotonic() + t_out
                while served < rest[0]:
                    sb.progress()
                    served += sb.serve_pulls(timeout_s=t_out)
                    if time.monotonic() > deadline:
                        raise TimeoutError("no pull to serve")
                conn.send(served)
            ep.poll_notifs()
    finally:
        pools.close()
        ep.close()
        conn.close()


class GpuBench:
    """Agent A with the source cache here; agent B with the destination cache in a child
    process on the other GPU (two engines, as in a deployment); for the two-senders case
    agent C with another source cache in a third process (on A's GPU)."""

    def __init__(self, args: argparse.Namespace, tokens: int, src_dev: torch.device,
                 dst_dev: torch.device) -> None:
        self.args = args
        self.tokens = tokens
        self.src_dev, self.dst_dev = src_dev, dst_dev
        self.n = tokens // args.block_size
        self.conn, self.proc = self._spawn("dst", dst_dev)
        self.c_conn: Any = None
        self.src = datapath.make_cache(args, self.n, src_dev, fill_seed=args.seed + 1)
        self.ls = KvLayout.from_tensors(self.src, args.block_size)
        self.vs = region_byte_views(self.src, self.ls)
        self.nbytes = self.n * self.ls.bytes_per_block * self.ls.num_regions
        self.a = NixlEndpoint(f"gpu-src-{tokens}")
        self.a.register_layout(self.ls)
        self.pools = Pools(self.a, self.src, self.ls, args.no_kernel, all_pools(args))
        self.b_name, self.b_meta, ld_fields = self.conn.recv()
        self.ld = KvLayout.from_proto_fields(**ld_fields)
        self.a.add_peer(self.b_name, self.b_meta)
        self._call("addpeer", self.a.name, self.a.metadata(), self.ls.to_proto_fields())
        self.check = Checksummer()
        self._xfer = 0
        self.pool = ""
        self.use_pool("shipped")

    def _spawn(self, role: str, dev: torch.device) -> tuple[Any, Any]:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_engine_main, daemon=True,
                           args=(role, self.args, self.tokens,
                                 (dev.index or 0) if dev.type == "cuda" else -1, child))
        proc.start()
        return conn, proc

    def second_sender(self) -> None:
        """Start agent C (the second sender) once; it and B learn each other."""
        if self.c_conn is not None:
            return
        self.c_conn, self.c_proc = self._spawn("src2", self.src_dev)
        self.c_name, c_meta, c_fields = self.c_conn.recv()
        self._call("addpeer", self.c_name, c_meta, c_fields)
        self.c_conn.send(("addpeer", self.b_name, self.b_meta, self.ld.to_proto_fields()))
        assert self.c_conn.recv() == "ok"
        self.c_conn.send(("pool", self.pool, True))
        self.c_conn.recv()

    def use_pool(self, name: str, spin: bool = True) -> None:
        self.sa = self.pools.use(name, spin)
        self.b_info = self._call("pool", name, spin)
        if self.c_conn is not None:
            self.c_conn.send(("pool", name, spin))
            self.c_conn.recv()
        self.pool = name

    def close(self) -> None:
        try:
            self.conn.send(("stop",))
            self.proc.join(30)
            if self.c_conn is not None:
                self.c_conn.send(("stop",))
                self.c_proc.join(30)
        finally:
            self.pools.close()
            self.a.close()

    def ids(self, pattern: str) -> tuple[np.ndarray, np.ndarray]:
        if pattern == "contiguous":
            return np.arange(self.n), np.arange(self.n)
        rng = np.random.default_rng(self.args.seed)
        return rng.permutation(self.n), rng.permutation(self.n)

    def _call(self, *cmd: Any, serve: bool = False) -> Any:
        """Ask B; while it works, keep A progressing (and serving pulls when ``serve``)."""
        self.conn.send(cmd)
        while not self.conn.poll(0):
            if serve:
                self.sa.progress()
                self.sa.serve_pulls(timeout_s=self.args.timeout)
            else:
                self.a.poll_notifs()
            time.sleep(20e-6)
        return self.conn.recv()

    def clear_dst(self) -> None:
        self._call("clear")

    def dst_checksum(self, dids: np.ndarray) -> torch.Tensor:
        return self._call("checksum", dids)

    def run_once(self, op: str, strategy: str, sids: np.ndarray, dids: np.ndarray) -> dict[str, Any]:
        t_out = self.args.timeout
        self._xfer += 1
        xid = f"g{self._xfer}"
        sync(self.src_dev)
        descs, plan_ms = 0, 0.0
        if op == "READ":
            ms, descs = self._call("read", strategy, self.a.name, sids, dids, xid,
                                   serve=strategy == "pack")
            if ms == "error":
                raise CaseError(descs)
            if strategy == "pack":
                descs = self.sa.last_send_chunks
            return {"ms": ms, "num_descs": descs, "plan_ms": plan_ms}
        self.conn.send(("expect", strategy, self.a.name, xid))
        t0 = time.perf_counter()
        if strategy == "pack":
            self.sa.send(self.b_name, self.b_info, sids, dids, xid, timeout_s=t_out)
            descs = self.sa.last_send_chunks
        else:
            plan = plan_transfer(self.ls, sids, self.ld, dids, op="WRITE",
                                 coalesce=strategy == "runs")
            plan_ms = (time.perf_counter() - t0) * 1e3
            x = self.a.write(plan, self.b_name, xid.encode())
            self.a.wait(x, t_out)
            descs = plan.num_descs
        t_done = self.conn.recv()
        return {"ms": (t_done - t0) * 1e3, "num_descs": descs, "plan_ms": plan_ms}

    def two_senders(self, op: str, sids: np.ndarray, dids: np.ndarray) -> dict[str, Any]:
        """A and C pack into B at the same time, half of B's blocks each (WRITE: both push
        from the same instant; READ: B pulls from both at once). Per sender: ms from the
        start to its transfer's completion at B; every byte checksum-verified."""
        self.second_sender()
        half = self.n // 2
        c_src = np.random.default_rng(self.args.seed + 3).permutation(self.n)[:self.n - half]
        jobs = {"A": (sids[:half], dids[:half]), "C": (c_src, dids[half:])}
        self.clear_dst()
        self._xfer += 1
        xa, xc = f"tA{self._xfer}", f"tC{self._xfer}"
        t_go = time.perf_counter() + 0.05
        if op == "WRITE":
            self.conn.send(("expect_all", [xa, xc]))
            self.c_conn.send(("send", self.b_name, *jobs["C"], xc, t_go))
            while time.perf_counter() < t_go:
                pass
            self.sa.send(self.b_name, self.b_info, *jobs["A"], xa, timeout_s=self.args.timeout)
            self.c_conn.recv()
            done = self.conn.recv()
        else:
            self.c_conn.send(("serve", 1))
            done = self._call("pull_all", [(self.a.name, *jobs["A"], xa),
                                           (self.c_name, *jobs["C"], xc)], t_go, serve=True)
            self.c_conn.recv()
        ok_a = bool(torch.equal(self.dst_checksum(jobs["A"][1]), self.check(self.vs, jobs["A"][0])))
        self.c_conn.send(("checksum", jobs["C"][0]))
        want_c = self.c_conn.recv()
        ok_c = bool(torch.equal(self.dst_checksum(jobs["C"][1]), want_c))
        bpb = self.ls.bytes_per_block * self.ls.num_regions
        return {"A_ms": (done[xa] - t_go) * 1e3, "C_ms": (done[xc] - t_go) * 1e3,
                "A_bytes": half * bpb, "C_bytes": (self.n - half) * bpb,
                "all_ms": (max(done.values()) - t_go) * 1e3, "ok": ok_a and ok_c}

    def trace(self, sids: np.ndarray, dids: np.ndarray) -> dict[str, Any]:
        """One fragmented staged WRITE with both sides tracing: where a chunk's time goes."""
        self.clear_dst()
        self.sa.trace = []
        self.a.post_times = []
        self._call("trace", True)
        r = self.run_once("WRITE", "pack", sids, dids)
        posts, self.a.post_times = self.a.post_times, None
        tb, gb = self._call("trace", False) or ([], [])
        ta, self.sa.trace = self.sa.trace or [], None
        ga, self.sa.gpu_trace = self.sa.gpu_trace, []
        ev: dict[str, dict[int, float]] = {}
        for t, what, seq in ta + tb:
            ev.setdefault(what, {})[seq] = t
        out: dict[str, Any] = {"pool": self.pool, "tokens": self.tokens, "ms": round(r["ms"], 3),
                               "chunks": r["num_descs"]}

        def med(a: str, b: str) -> float | None:
            xs = [ev[b][c] - ev[a][c] for c in ev.get(a, {}) if c in ev.get(b, {})]
            return round(statistics.median(xs) * 1e6, 1) if xs else None

        out["grant_wait_us"] = round((ev.get("grant", {}).get(0, 0) - ev.get("send", {}).get(0, 0)) * 1e6, 1)
        # sender: gather launched → seen done → receive slot in hand → WRITE posted → done
        out["gather_seen_us"] = med("pack", "packed")
        out["packed_to_slot_us"] = med("packed", "posting")
        out["post_call_us"] = med("posting", "post")
        # of which: descriptor lists + NIXL request creation, and the post (transfer) call
        out["post_init_us"] = round(statistics.median(p[0] for p in posts) * 1e6, 1) if posts else None
        out["post_xfer_us"] = round(statistics.median(p[1] for p in posts) * 1e6, 1) if posts else None
        out["gather_to_post_us"] = med("pack", "post")
        out["post_to_write_done_us"] = med("post", "wrote")
        out["post_to_chunk_at_receiver_us"] = med("post", "chunk")
        out["chunk_to_scattered_ack_us"] = med("chunk", "acked")
        # receiver: notification handled → scatter launched → seen done → ack sent
        out["scatter_launch_us"] = med("chunk", "unpack")
        out["scatter_seen_us"] = med("unpack", "scattered")
        out["ack_call_us"] = med("scattered", "acked")
        out["ack_to_sender_us"] = med("acked", "ack")
        out["slot_cycle_us"] = med("pack", "ack")
        out["recv_slot_cycle_us"] = med("posting", "ack")  # a receive slot: taken → back
        for kind in ("gather", "scatter"):  # GPU time of each kernel (CUDA timing events)
            xs = [us for k, _, us in ga + gb if k == kind]
            out[f"{kind}_gpu_us"] = round(statistics.median(xs), 1) if xs else None
        posts = sorted(ev.get("post", {}).values())
        gaps = [b - a for a, b in zip(posts, posts[1:])]
        out["post_interval_us"] = round(statistics.median(gaps) * 1e6, 1) if gaps else None
        return out

    def profile(self, sids: np.ndarray, dids: np.ndarray, out_dir: Path) -> dict[str, Any]:
        """One fragmented staged WRITE with both sides under cProfile (CPU time per function,
        top by own time): where each side's thread spends a chunk's CPU time."""
        import cProfile
        import io
        import pstats

        self.clear_dst()
        self._call("profile", True)
        pr = cProfile.Profile()
        pr.enable()
        r = self.run_once("WRITE", "pack", sids, dids)
        pr.disable()
        recv_txt = self._call("profile", False)
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
        out = {"pool": self.pool, "tokens": self.tokens, "ms": round(r["ms"], 3), "chunks": r["num_descs"]}
        out_dir.mkdir(parents=True, exist_ok=True)
        for side, txt in (("sender", buf.getvalue()), ("receiver", recv_txt)):
            path = out_dir / f"profile_{self.pool}_{self.tokens}_{side}.txt"
            path.write_text(f"# one fragmented staged WRITE, {out}, {side} side under cProfile\n{txt}")
            out[side] = path.name
        return out

    def raw_copy(self) -> float:
        """``dst.copy_(src)`` per layer tensor (a peer copy across GPUs), median ms."""
        dst = datapath.make_cache(self.args, self.n, self.dst_dev, fill_seed=None)
        times = []
        for _ in range(self.args.warmup + self.args.iters):
            sync(self.src_dev, self.dst_dev)
            t0 = time.perf_counter()
            for s, d in zip(self.src, dst):
                d.copy_(s)
            sync(self.dst_dev, self.src_dev)
            times.append((time.perf_counter() - t0) * 1e3)
        ids = np.arange(self.n)
        vd = region_byte_views(dst, KvLayout.from_tensors(dst, self.args.block_size))
        assert torch.equal(self.check(self.vs, ids), self.check(vd, ids)), "raw copy differs"
        del dst, vd
        if self.dst_dev.type == "cuda":
            torch.cuda.empty_cache()
        return statistics.median(times[self.args.warmup:])

    def kernels(self, sids: np.ndarray, dids: np.ndarray) -> list[dict[str, Any]]:
        """Gather and scatter (into a scratch cache) alone, on the source GPU, no transfer, over all
        tiles of a fragmented transfer: the Triton one-launch kernel against one torch
        index_select / index_copy_ per region. Scatters write the destination cache only."""
        tiles = plan_tiles(self.n, self.ls.num_regions, self.ls.bytes_per_block,
                           self.sa.tile_bytes(self.n))
        out: list[dict[str, Any]] = []
        si = torch.from_numpy(sids).to(self.src_dev)
        scratch = datapath.make_cache(self.args, self.n, self.src_dev, fill_seed=None)
        lsc = KvLayout.from_tensors(scratch, self.args.block_size)
        vsc = region_byte_views(scratch, lsc)
        di = torch.from_numpy(dids).to(self.src_dev)
        sslot, dslot = self.sa.send_pool.slot(0), self.sa.recv_pool.slot(0)
        ca = self.sa.copier
        cb = GpuRowCopier(scratch, lsc) if ca is not None else None
        if ca is not None:  # the kernel against torch, on the first tile
            r0, r1, b0, b1 = tiles[0]
            ref = torch.empty_like(sslot)
            nb = pack_blocks(self.vs[r0:r1], si[b0:b1], ref)
            ca.gather(si[b0:b1], r0, r1, sslot)
            sync(self.src_dev)
            assert torch.equal(sslot[:nb], ref[:nb]), "triton gather differs from index_select"
            del ref

        def timed(fn: Any, dev: torch.device) -> float:
            ts = []
            with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
                for _ in range(self.args.warmup + self.args.iters):
                    sync(dev)
                    t0 = time.perf_counter()
                    for t in tiles:
                        fn(*t)
                    sync(dev)
                    ts.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(ts[self.args.warmup:])

        cases: dict[str, tuple[Any, torch.device]] = {
            "gather_torch": (lambda r0, r1, b0, b1: pack_blocks(self.vs[r0:r1], si[b0:b1], sslot),
                             self.src_dev),
            "scatter_torch": (lambda r0, r1, b0, b1: unpack_blocks(vsc[r0:r1], di[b0:b1], dslot),
                              self.src_dev),
        }
        if ca is not None and cb is not None:
            cases["gather_triton"] = (lambda r0, r1, b0, b1: ca.gather(si[b0:b1], r0, r1, sslot),
                                      self.src_dev)
            cases["scatter_triton"] = (lambda r0, r1, b0, b1: cb.scatter(di[b0:b1], r0, r1, dslot),
                                       self.src_dev)
        for name, (fn, dev) in cases.items():
            ms = timed(fn, dev)
            out.append({"kernel": name, "tiles": len(tiles), "ms": round(ms, 3),
                        "gbps": round(self.nbytes / (ms / 1e3) / GB, 1)})
        cases.clear()  # its closures hold the scratch cache: drop them before empty_cache
        scratch = vsc = cb = None
        if self.src_dev.type == "cuda":
            torch.cuda.empty_cache()
        return out


def measure(bench: GpuBench, op: str, strategy: str, sids: np.ndarray, dids: np.ndarray,
            warmup: int, iters: int, want: torch.Tensor) -> tuple[list[float], int, float, bool]:
    times, ok_all, plan_ms, descs = [], True, 0.0, 0
    for i in range(warmup + iters):
        bench.clear_dst()
        r = bench.run_once(op, strategy, sids, dids)
        ok = bool(torch.equal(bench.dst_checksum(dids), want))
        ok_all &= ok
        if i >= warmup:
            times.append(r["ms"])
            plan_ms, descs = r["plan_ms"], r["num_descs"]
            if r["ms"] > 2000:  # seconds-long cases (per-descriptor READs): one run says enough
                break
        elif r["ms"] > 2000:
            warmup = i + 1  # no more warm-ups for such a case either
    return times, descs, plan_ms, ok_all


def _pack_row(bench: GpuBench, tokens: int, op: str, pattern: str, pool: str, sids: np.ndarray,
              dids: np.ndarray, want: torch.Tensor, base_ms: float, policy: str,
              **extra: Any) -> dict[str, Any]:
    times, descs, _, ok = measure(bench, op, "pack", sids, dids, bench.args.warmup,
                                  bench.args.iters, want)
    row = datapath._row(tokens, op, pattern, f"pack@{pool}", statistics.median(times),
                        bench.nbytes, descs, 0.0, ok, times)
    row.update(policy_choice=policy, raw_copy_ratio=round(base_ms / row["ms"], 3), pool=pool,
               staging_mib=pool_by_name(pool).total_bytes // MiB, **extra)
    print(datapath._fmt(row) + f"  {row['raw_copy_ratio']:.0%} of raw", flush=True)
    if not ok:
        raise SystemExit(f"verification FAILED: {row}")
    return row


def run_suite(args: argparse.Namespace, tokens: int, src: torch.device, dst: torch.device,
              largest: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    bench = GpuBench(args, tokens, src, dst)
    rows: list[dict[str, Any]] = []
    kernels: list[dict[str, Any]] = []
    traces: list[dict[str, Any]] = []
    pools = [p for p in args.pools.split(",") if p]
    try:
        base_ms = bench.raw_copy()
        rows.append(datapath._row(tokens, "COPY", "contiguous", "plain_copy", base_ms,
                                  bench.nbytes, 0, 0.0, True, [base_ms]))
        print(datapath._fmt(rows[-1]), flush=True)
        for pattern in args.patterns.split(","):
            sids, dids = bench.ids(pattern)
            want = bench.check(bench.vs, sids)
            nruns = len(coalesce_runs(sids, dids)[0]) * bench.ls.num_regions
            policy = choose_strategy(nruns, bench.nbytes, device="cuda")
            for op in args.ops.split(","):
                for strategy in args.strategies.split(","):
                    if strategy == "pack":
                        for pool in pools:
                            bench.use_pool(pool)
                            rows.append(_pack_row(bench, tokens, op, pattern, pool, sids, dids,
                                                  want, base_ms, policy))
                        bench.use_pool("shipped")
                        continue
                    pb = strategy == "per_block"
                    try:
                        times, descs, plan_ms, ok = measure(
                            bench, op, strategy, sids, dids, 0 if pb else args.warmup,
                            args.per_block_iters if pb else args.iters, want)
                    except CaseError as e:
                        print(f"{tokens:>6} {op:<5} {pattern:<10} {strategy:<10} FAILED: {e}",
                              flush=True)
                        rows.append({"tokens": tokens, "op": op, "pattern": pattern,
                                     "strategy": strategy, "error": str(e)[:300],
                                     "nbytes": bench.nbytes, "policy_choice": policy})
                        continue
                    row = datapath._row(tokens, op, pattern, strategy, statistics.median(times),
                                        bench.nbytes, descs, plan_ms, ok, times)
                    row["policy_choice"] = policy
                    row["raw_copy_ratio"] = round(base_ms / row["ms"], 3)
                    rows.append(row)
                    print(datapath._fmt(row) + f"  {row['raw_copy_ratio']:.0%} of raw", flush=True)
                    if not ok:
                        raise SystemExit(f"verification FAILED: {row}")
            if pattern != "fragmented":
                continue
            # pool shapes within 256 MiB per engine, and the poll interval's share
            sweep = [p for p in args.sweep_pools.split(",") if p and p not in pools]
            for pool in sweep:
                bench.use_pool(pool)
                for op in args.ops.split(","):
                    rows.append(_pack_row(bench, tokens, op, pattern, pool, sids, dids, want,
                                          base_ms, policy, sweep=True))
            if args.nospin and largest:
                bench.use_pool("shipped", spin=False)
                for op in args.ops.split(","):
                    rows.append(_pack_row(bench, tokens, op, pattern, "shipped-nospin", sids, dids,
                                          want, base_ms, policy, sweep=True))
            bench.use_pool("shipped")
            if args.two_senders:
                bench.use_pool(args.two_senders)
                for op in args.ops.split(","):
                    res = [bench.two_senders(op, sids, dids)
                           for _ in range(args.warmup + args.iters)][args.warmup:]
                    r2 = {"tokens": tokens, "op": op, "pattern": pattern, "two_senders": True,
                          "strategy": f"pack@{args.two_senders} ×2", "pool": args.two_senders,
                          "nbytes": bench.nbytes, "verified": all(r["ok"] for r in res),
                          "staging_mib": pool_by_name(args.two_senders).total_bytes // MiB}
                    for k in ("A", "C"):
                        ms = statistics.median(r[f"{k}_ms"] for r in res)
                        r2[f"{k}_ms"] = round(ms, 3)
                        r2[f"{k}_gbps"] = round(res[0][f"{k}_bytes"] / (ms / 1e3) / GB, 1)
                    ms = statistics.median(r["all_ms"] for r in res)
                    r2["ms"] = round(ms, 3)
                    r2["gbps"] = round(bench.nbytes / (ms / 1e3) / GB, 1)
                    r2["raw_copy_ratio"] = round(base_ms / ms, 3)
                    rows.append(r2)
                    print(f"{tokens:>6} {op:<5} two senders into one receiver: A {r2['A_gbps']} GB/s, "
                          f"C {r2['C_gbps']} GB/s, together {r2['gbps']} GB/s "
                          f"({'ok' if r2['verified'] else 'FAIL'})", flush=True)
                    if not r2["verified"]:
                        raise SystemExit(f"verification FAILED: {r2}")
                bench.use_pool("shipped")
            if largest:
                for pool in [p for p in args.trace.split(",") if p]:
                    bench.use_pool(pool)
                    t = bench.trace(sids, dids)
                    traces.append(t)
                    print(f"trace {t}", flush=True)
                for pool in [p for p in args.profile.split(",") if p]:
                    bench.use_pool(pool)
                    t = bench.profile(sids, dids, Path(args.out).parent)
                    traces.append(dict(t, profile=True))
                    print(f"profile {t}", flush=True)
                bench.use_pool("shipped")
                kernels = [dict(k, tokens=tokens) for k in bench.kernels(sids, dids)]
                for k in kernels:
                    print(f"{tokens:>6} kernel {k['kernel']:<15} {k['ms']:>8.3f} ms "
                          f"{k['gbps']:>8.1f} GB/s ({k['tiles']} tiles)", flush=True)
    finally:
        bench.close()
        del bench
    return rows, kernels, traces


NAMES = {"runs": "coalesced runs", "per_block": "NIXL per-block", "plain_copy": "raw peer copy"}


def _path_name(r: dict[str, Any]) -> str:
    s = r["strategy"]
    if s.startswith("pack@"):
        pool = r.get("pool", s[5:])
        base, variant = base_pool(pool)
        tag = "connector, shipped defaults" if pool == "shipped" else "connector"
        label = pool_label(base) + (f", {VARIANTS[variant]}" if variant else "")
        two = " — two senders at once" if r.get("two_senders") else ""
        return f"{tag}: staged pack ({label}){two}"
    return NAMES.get(s, s)


def markdown(rows: list[dict[str, Any]], kernels: list[dict[str, Any]], env: dict[str, Any]) -> str:
    traces = env.get("traces", [])
    label = f", {env['label']}" if env.get("label") else ""
    lines = [f"# GPU data path: {env.get('gpus')} ({env.get('src')} → {env.get('dst')}){label}", "",
             f"Commit {env.get('commit') or '?'}. Qwen3-32B-shaped cache (64 layers, 8 KV heads × 128, "
             "bf16, 16-token blocks, 32 KiB per layer-K/V block). Median ms; GB/s of KV bytes "
             "moved; 'descs' is NIXL descriptors (chunks for the staged path); every run "
             "checksum-verified. 'policy' = what choose_strategy picks. Staging memory is per "
             "engine (send + receive pools).", "",
             "| tokens | GiB | pattern | op | path | ms | GB/s | % of raw copy | descs | policy | ok |",
             "|---:|---:|---|---|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        if r.get("sweep") or r.get("two_senders"):
            continue
        if "error" in r and "op" not in r:
            lines.append(f"| {r['tokens']} | | | | suite failed | | | | | | {r['error'][:80]} |")
            continue
        if "error" in r:
            lines.append(f"| {r['tokens']} | {r['nbytes'] / 2**30:.2f} | {r['pattern']} | {r['op']} | "
                         f"{_path_name(r)} | failed | — | — | — | "
                         f"{r.get('policy_choice', '')} | {r['error'][:80]} |")
            continue
        lines.append(f"| {r['tokens']} | {r['nbytes'] / 2**30:.2f} | {r['pattern']} | {r['op']} | "
                     f"{_path_name(r)} | {r['ms']:.2f} | {r['gbps']:.1f} | "
                     f"{r.get('raw_copy_ratio', 1.0):.0%} | {r['num_descs']} | "
                     f"{r.get('policy_choice', '')} | {'yes' if r['verified'] else 'NO'} |")
    two = [r for r in rows if r.get("two_senders")]
    if two:
        lines += ["", "Two senders packing into one receiver at the same time (fragmented, half of the "
                  "blocks each; WRITE: both push from the same instant; READ: the receiver pulls "
                  "from both at once). ms from the common start to each sender's transfer "
                  "completing at the receiver; every byte checksum-verified:", "",
                  "| tokens | op | pool | sender A GB/s | sender C GB/s | both: ms | both: GB/s | "
                  "% of raw copy | ok |", "|---:|---|---|---:|---:|---:|---:|---:|---|"]
        for r in two:
            lines.append(f"| {r['tokens']} | {r['op']} | {pool_label(r['pool'])} | {r['A_gbps']} | "
                         f"{r['C_gbps']} | {r['ms']:.2f} | {r['gbps']} | {r['raw_copy_ratio']:.0%} | "
                         f"{'yes' if r['verified'] else 'NO'} |")
    sw = [r for r in rows if r.get("sweep")]
    if sw:
        lines += ["", "Pool shapes (fragmented, staged path; SLOT MiB × receive + send slots, "
                  "target chunks):", "",
                  "| tokens | op | pool | staging MiB/engine | chunks | ms | GB/s | % of raw |",
                  "|---:|---|---|---:|---:|---:|---:|---:|"]
        for r in sw:
            lines.append(f"| {r['tokens']} | {r['op']} | {r['pool']} | {r['staging_mib']} | "
                         f"{r['num_descs']} | {r['ms']:.2f} | {r['gbps']:.1f} | "
                         f"{r['raw_copy_ratio']:.0%} |")
    if traces:
        keys = ["grant_wait_us", "gather_gpu_us", "gather_seen_us", "packed_to_slot_us", "post_call_us",
                "post_init_us", "post_xfer_us", "post_to_write_done_us", "post_to_chunk_at_receiver_us", "scatter_launch_us",
                "scatter_gpu_us", "scatter_seen_us", "ack_call_us", "chunk_to_scattered_ack_us",
                "ack_to_sender_us", "recv_slot_cycle_us", "slot_cycle_us", "post_interval_us"]
        lines += ["", "Where a staged WRITE's time goes (one fragmented WRITE, both sides traced; "
                  "medians over chunks, µs). Sender: gather_gpu (the gather kernel's GPU time), "
                  "gather_seen (launch → its event seen done), packed_to_slot (→ a receive slot "
                  "in hand), post_call (the NIXL post itself), post_to_write_done. Receiver: "
                  "post_to_chunk_at_receiver (post → the chunk's notification handled), "
                  "scatter_launch, scatter_gpu, scatter_seen (launch → event seen done), ack_call; "
                  "ack_to_sender; recv_slot_cycle (a receive slot taken for a post → its ack back "
                  "at the sender), slot_cycle (gather launch → ack):", "",
                  "| tokens | pool | ms | chunks | " + " | ".join(k.removesuffix("_us") for k in keys) + " |",
                  "|---:|---|---:|---:|" + "---:|" * len(keys)]
        for t in traces:
            if t.get("profile"):
                continue
            lines.append(f"| {t['tokens']} | {t['pool']} | {t['ms']} | {t['chunks']} | "
                         + " | ".join(str(t.get(k)) for k in keys) + " |")
    if kernels:
        lines += ["", "Gather/scatter alone (fragmented, all tiles of the shipped pool, one GPU):", "",
                  "| tokens | kernel | tiles | ms | GB/s |", "|---:|---|---:|---:|---:|"]
        for k in kernels:
            lines.append(f"| {k['tokens']} | {k['kernel']} | {k['tiles']} | {k['ms']:.3f} | "
                         f"{k['gbps']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() and not args.cpu:
        print("skipped: no CUDA")
        return 0
    try:
        importlib.import_module("nixl")  # fail early, with what to install
    except ImportError as e:
        print(f"error: nixl is not importable ({e}); install nixl + nixl-cu13 wheels with --no-deps")
        return 2
    if args.cpu:
        os.environ.setdefault("UCX_TLS", "tcp,self,sm")
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        src = dst = torch.device("cpu")
        names = ["cpu"]
    else:
        ngpu = torch.cuda.device_count()
        src, dst = torch.device("cuda:0"), torch.device("cuda:1" if ngpu > 1 else "cuda:0")
        torch.cuda.set_device(src)
        enable_peer_access()
        if ngpu > 1:
            print(f"peer access cuda:0 → cuda:1: {torch.cuda.can_device_access_peer(0, 1)}")
        names = [torch.cuda.get_device_name(i) for i in range(ngpu)]
    print(f"{len(names)} device(s) {names}; {src} → {dst}; {args.layers} layers, {args.kv_heads} KV heads"
          f" × {args.head_dim}, {args.block_size}-token blocks; pools: "
          + "; ".join(pool_label(p) for p in args.pools.split(",") if p), flush=True)
    print(datapath.header(), flush=True)
    rows: list[dict[str, Any]] = []
    kernels: list[dict[str, Any]] = []
    traces: list[dict[str, Any]] = []
    for tokens in args.tokens:
        try:
            r, k, t = run_suite(args, tokens, src, dst, largest=tokens == max(args.tokens))
        except Exception as e:  # noqa: BLE001 - keep the other sizes
            import traceback
            traceback.print_exc()
            print(f"{tokens} tokens FAILED: {type(e).__name__}: {e}", flush=True)
            rows.append({"tokens": tokens, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        rows += r
        kernels += k
        traces += t
        if not args.cpu:
            torch.cuda.empty_cache()
    extra = {"device": "cuda", "gpus": names, "src": str(src), "dst": str(dst),
             "cuda": torch.version.cuda, "kernels": kernels, "traces": traces,
             "commit": args.commit, "shipped_pool": pool_label("shipped"), "label": args.label}
    datapath.write_json(args.out, args, rows, extra)
    md = args.md or str(Path(args.out).with_suffix(".md"))
    Path(md).write_text(markdown(rows, kernels, extra))
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
