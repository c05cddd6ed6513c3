"""Data-path benchmark on CUDA tensors: NIXL WRITE/READ of a KV cache between GPUs.

For 1k/4k/16k tokens of a Qwen3-32B-shaped cache (64 layers, 8 KV heads × 128, bf16,
16-token blocks: 32 KiB per layer-K/V block), source on ``cuda:0`` and destination on
``cuda:1`` when two GPUs are visible (else both on ``cuda:0``), contiguous and fragmented
(random permutation) block ids, WRITE and READ, it times

* ``pack``      — the connector's staged path: one gather kernel per chunk into a
  registered slot, one NIXL WRITE per chunk, one scatter kernel per chunk on the
  receiver, pipelined (a staged READ is a pull request answered by a staged WRITE);
* ``runs``      — one NIXL descriptor per coalesced run (per region);
* ``per_block`` — one NIXL descriptor per block (per region);
* ``plain_copy``— a raw peer copy ``dst.copy_(src)`` of the same bytes;

and, on one GPU, the gather/scatter kernels alone (Triton one-launch vs torch per
region). Every transfer is verified: per-region order-sensitive checksums of the
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
import importlib
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
    GpuRowCopier,
    StagedPeer,
    choose_strategy,
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
    p.add_argument("--slot-mib", type=int, default=256, help="staging slot size (MiB)")
    p.add_argument("--slots", type=int, default=4, help="staging slots per pool")
    p.add_argument("--chunks", type=int, default=16, help="target chunks per staged transfer")
    p.add_argument("--min-chunk-mib", type=int, default=4)
    p.add_argument("--sweep-chunks", default="4,8,16,32,64",
                   help="chunk targets tried on the largest size, fragmented (empty: none)")
    p.add_argument("--no-kernel", action="store_true", help="torch gathers instead of Triton")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one iteration")
    p.add_argument("--out", default=str(datapath.REPO / "benchmarks/results/datapath_gpu.json"))
    p.add_argument("--md", default=None, help="markdown table path (default: --out with .md)")
    a = p.parse_args(argv)
    if a.smoke:
        a.tokens, a.layers, a.iters, a.warmup, a.per_block_iters = [256, 1024], 4, 1, 1, 1
        a.sweep_chunks = "4,16"
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


def _staged_kw(args: argparse.Namespace) -> dict[str, Any]:
    return dict(slot_bytes=args.slot_mib << 20, num_slots=args.slots, target_chunks=args.chunks,
                min_chunk_bytes=args.min_chunk_mib << 20,
                use_kernel=False if args.no_kernel else None)


def _dst_main(args: argparse.Namespace, tokens: int, dev_index: int, conn: Any) -> None:
    """The receiving engine, in its own process (UCX refuses CUDA IPC between two agents of
    one process and would fall back to TCP): owns the destination cache and agent B."""
    dev = torch.device(f"cuda:{dev_index}") if dev_index >= 0 else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        enable_peer_access()
    n = tokens // args.block_size
    dst = datapath.make_cache(args, n, dev, fill_seed=None)
    ld = KvLayout.from_tensors(dst, args.block_size)
    vd = region_byte_views(dst, ld)
    b = NixlEndpoint(f"gpu-dst-{tokens}")
    b.register_layout(ld)
    sb = StagedPeer(b, dst, ld, **_staged_kw(args))
    check = Checksummer()
    conn.send((b.name, b.metadata(), sb.info(), ld.to_proto_fields()))
    peer, meta, la_fields = conn.recv()
    b.add_peer(peer, meta)
    la = KvLayout.from_proto_fields(**la_fields)
    t_out = args.timeout
    try:
        while True:
            cmd, *rest = conn.recv()
            if cmd == "stop":
                break
            if cmd == "clear":
                for t in dst:
                    t.zero_()
                sync(dev)
                conn.send("ok")
            elif cmd == "checksum":
                conn.send(check(vd, rest[0]))
            elif cmd == "expect":  # the peer WRITEs: done when the data is in our blocks
                strategy, xid = rest
                if strategy == "pack":
                    sb.wait_complete(xid, timeout_s=t_out)
                else:  # a WRITE's notification arrives after its data
                    b.wait_notif(peer, xid.encode(), timeout_s=t_out)
                sync(dev)
                conn.send(time.perf_counter())
            elif cmd == "read":
                strategy, sids, dids, xid = rest
                t0 = time.perf_counter()
                descs = 0
                if strategy != "pack":
                    try:
                        plan = plan_transfer(ld, dids, la, sids, op="READ",
                                             coalesce=strategy == "runs")
                        x = b.read(plan, peer, xid.encode())
                        b.wait(x, t_out)
                    except Exception as e:  # noqa: BLE001 - reported as the case's result
                        conn.send(("error", f"{type(e).__name__}: {e}"))
                        continue
                    descs = plan.num_descs
                elif strategy == "pack":
                    sb.request_pull(peer, sids, dids, xid)
                    sb.wait_complete(xid, timeout_s=t_out)
                sync(dev)
                conn.send(((time.perf_counter() - t0) * 1e3, descs))
            b.poll_notifs()
    finally:
        sb.close()
        b.close()
        conn.close()


class GpuBench:
    """Agent A with the source cache here; agent B with the destination cache in a child
    process on the other GPU (two engines, as in a deployment)."""

    def __init__(self, args: argparse.Namespace, tokens: int, src_dev: torch.device,
                 dst_dev: torch.device) -> None:
        import multiprocessing as mp

        self.args = args
        self.src_dev, self.dst_dev = src_dev, dst_dev
        self.n = tokens // args.block_size
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_dst_main, args=(args, tokens, (dst_dev.index or 0) if dst_dev.type == "cuda" else -1, child),
                                daemon=True)
        self.proc.start()
        self.src = datapath.make_cache(args, self.n, src_dev, fill_seed=args.seed + 1)
        self.ls = KvLayout.from_tensors(self.src, args.block_size)
        self.vs = region_byte_views(self.src, self.ls)
        self.nbytes = self.n * self.ls.bytes_per_block * self.ls.num_regions
        self.a = NixlEndpoint(f"gpu-src-{tokens}")
        self.a.register_layout(self.ls)
        self.sa = StagedPeer(self.a, self.src, self.ls, **_staged_kw(args))
        self.b_name, b_meta, self.b_info, ld_fields = self.conn.recv()
        self.ld = KvLayout.from_proto_fields(**ld_fields)
        self.a.add_peer(self.b_name, b_meta)
        self.conn.send((self.a.name, self.a.metadata(), self.ls.to_proto_fields()))
        self.check = Checksummer()
        self._xfer = 0

    def close(self) -> None:
        try:
            self.conn.send(("stop",))
            self.proc.join(30)
        finally:
            self.sa.close()
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
            ms, descs = self._call("read", strategy, sids, dids, xid, serve=strategy == "pack")
            if ms == "error":
                raise CaseError(descs)
            if strategy == "pack":
                descs = self.sa.last_send_chunks
            return {"ms": ms, "num_descs": descs, "plan_ms": plan_ms}
        self.conn.send(("expect", strategy, xid))
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
    return times, descs, plan_ms, ok_all


def run_suite(args: argparse.Namespace, tokens: int, src: torch.device, dst: torch.device,
              sweep: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    bench = GpuBench(args, tokens, src, dst)
    rows: list[dict[str, Any]] = []
    kernels: list[dict[str, Any]] = []
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
            if pattern == "fragmented":
                kernels = [dict(k, tokens=tokens) for k in bench.kernels(sids, dids)]
                for k in kernels:
                    print(f"{tokens:>6} kernel {k['kernel']:<15} {k['ms']:>8.3f} ms "
                          f"{k['gbps']:>8.1f} GB/s ({k['tiles']} tiles)", flush=True)
                if sweep and args.sweep_chunks:
                    for c in [int(x) for x in args.sweep_chunks.split(",")]:
                        bench.sa.target_chunks = c
                        for op in args.ops.split(","):
                            times, descs, _, ok = measure(bench, op, "pack", sids, dids,
                                                          args.warmup, args.iters, want)
                            row = datapath._row(tokens, op, pattern, f"pack@{c}",
                                                statistics.median(times), bench.nbytes, descs,
                                                0.0, ok, times)
                            row["raw_copy_ratio"] = round(base_ms / row["ms"], 3)
                            row["sweep"] = True
                            rows.append(row)
                            print(datapath._fmt(row) + f"  {row['raw_copy_ratio']:.0%} of raw",
                                  flush=True)
                            if not ok:
                                raise SystemExit(f"verification FAILED: {row}")
                    bench.sa.target_chunks = args.chunks
    finally:
        bench.close()
        del bench
    return rows, kernels


def markdown(rows: list[dict[str, Any]], kernels: list[dict[str, Any]], env: dict[str, Any]) -> str:
    names = {"pack": "connector: staged pack (pipelined)", "runs": "coalesced runs",
             "per_block": "NIXL per-block", "plain_copy": "raw peer copy"}
    lines = [f"# GPU data path: {env.get('gpus')} ({env.get('src')} → {env.get('dst')})", "",
             "Qwen3-32B-shaped cache (64 layers, 8 KV heads × 128, bf16, 16-token blocks, "
             "32 KiB per layer-K/V block). Median ms; GB/s of KV bytes moved; 'descs' is "
             "NIXL descriptors (chunks for the staged path); every run checksum-verified. "
             "'policy' = what choose_strategy picks.", "",
             "| tokens | GiB | pattern | op | path | ms | GB/s | % of raw copy | descs | policy | ok |",
             "|---:|---:|---|---|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        if r.get("sweep"):
            continue
        if "error" in r and "op" not in r:
            lines.append(f"| {r['tokens']} | | | | suite failed | | | | | | {r['error'][:80]} |")
            continue
        if "error" in r:
            lines.append(f"| {r['tokens']} | {r['nbytes'] / 2**30:.2f} | {r['pattern']} | {r['op']} | "
                         f"{names.get(r['strategy'], r['strategy'])} | failed | — | — | — | "
                         f"{r.get('policy_choice', '')} | {r['error'][:80]} |")
            continue
        lines.append(f"| {r['tokens']} | {r['nbytes'] / 2**30:.2f} | {r['pattern']} | {r['op']} | "
                     f"{names.get(r['strategy'], r['strategy'])} | {r['ms']:.2f} | {r['gbps']:.1f} | "
                     f"{r.get('raw_copy_ratio', 1.0):.0%} | {r['num_descs']} | "
                     f"{r.get('policy_choice', '')} | {'yes' if r['verified'] else 'NO'} |")
    sw = [r for r in rows if r.get("sweep")]
    if sw:
        lines += ["", "Chunk-count sweep (fragmented, staged path):", "",
                  "| tokens | op | target chunks | chunks | ms | GB/s | % of raw |",
                  "|---:|---|---:|---:|---:|---:|---:|"]
        for r in sw:
            lines.append(f"| {r['tokens']} | {r['op']} | {r['strategy'].split('@')[1]} | "
                         f"{r['num_descs']} | {r['ms']:.2f} | {r['gbps']:.1f} | "
                         f"{r['raw_copy_ratio']:.0%} |")
    if kernels:
        lines += ["", "Gather/scatter alone (fragmented, all tiles, one GPU):", "",
                  "| tokens | kernel | tiles | ms | GB/s |", "|---:|---|---:|---:|---:|"]
        for k in kernels:
            lines.append(f"| {k['tokens']} | {k['kernel']} | {k['tiles']} | {k['ms']:.3f} | "
                         f"{k['gbps']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    if not torch.cuda.is_available():
        print("skipped: no CUDA")
        return 0
    try:
        importlib.import_module("nixl")  # fail early, with what to install
    except ImportError as e:
        print(f"error: nixl is not importable ({e}); install nixl + nixl-cu13 wheels with --no-deps")
        return 2
    args = parse_args(argv)
    ngpu = torch.cuda.device_count()
    src, dst = torch.device("cuda:0"), torch.device("cuda:1" if ngpu > 1 else "cuda:0")
    torch.cuda.set_device(src)
    enable_peer_access()
    if ngpu > 1:
        print(f"peer access cuda:0 → cuda:1: {torch.cuda.can_device_access_peer(0, 1)}")
    names = [torch.cuda.get_device_name(i) for i in range(ngpu)]
    print(f"{ngpu} GPU(s) {names}; {src} → {dst}; {args.layers} layers, {args.kv_heads} KV heads"
          f" × {args.head_dim}, {args.block_size}-token blocks; chunks≈{args.chunks}, "
          f"{args.slots}×{args.slot_mib} MiB slots", flush=True)
    print(datapath.header(), flush=True)
    rows: list[dict[str, Any]] = []
    kernels: list[dict[str, Any]] = []
    for tokens in args.tokens:
        try:
            r, k = run_suite(args, tokens, src, dst, sweep=tokens == max(args.tokens))
        except Exception as e:  # noqa: BLE001 - keep the other sizes
            print(f"{tokens} tokens FAILED: {type(e).__name__}: {e}", flush=True)
            rows.append({"tokens": tokens, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        rows += r
        kernels += k
        torch.cuda.empty_cache()
    extra = {"device": "cuda", "gpus": names, "src": str(src), "dst": str(dst),
             "cuda": torch.version.cuda, "kernels": kernels}
    datapath.write_json(args.out, args, rows, extra)
    md = args.md or str(Path(args.out).with_suffix(".md"))
    Path(md).write_text(markdown(rows, kernels, extra))
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
