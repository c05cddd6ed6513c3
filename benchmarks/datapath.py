"""Data-path benchmark on host memory: NIXL WRITE/READ of a KV cache through kvbaton's code.

Moves the KV of ``--tokens`` tokens of a Qwen3-32B-shaped cache (64 layers, 8 KV heads,
head 128, 2-byte dtype, 16-token blocks: 32 KiB per layer-K/V-block, 4 GiB at 16k tokens)
between two NIXL agents, with contiguous and fragmented (random permutation) block ids,
by three strategies — one descriptor per block, coalesced runs, staged pack — beside a
plain memory copy of the same bytes. Every run is verified by comparing the blocks.

    python benchmarks/datapath.py --tokens 4096 --layers 16

Both agents live in this process and are driven by one thread (the passive side is
progressed between polls, as the connector's transfer thread does); UCX moves the bytes
(shared memory / CMA on one host). ``datapath_gpu.py`` reuses this file for CUDA tensors.
Needs torch, numpy and nixl, and kvbaton installed (``pip install --no-deps -e .``): the
connector is imported as ``kvbaton.connector``, the one name the product uses.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch  # before nixl: on GPUs torch must own the CUDA context first

from kvbaton.connector.transfer.descriptors import coalesce_runs, plan_transfer
from kvbaton.connector.transfer.geometry import KvLayout
from kvbaton.connector.transfer.nixl_agent import NixlEndpoint
from kvbaton.connector.transfer.staging import StagedPeer, choose_strategy, plan_tiles, region_byte_views

REPO = Path(__file__).resolve().parent.parent

STRATEGIES = ("per_block", "runs", "pack")
GB = 1e9


def parse_args(argv: Sequence[str] | None, default_out: str, gpu: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384] if gpu else [16384])
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=3, help="measured runs per case (median reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--ops", default="WRITE,READ")
    p.add_argument("--patterns", default="contiguous,fragmented")
    # GPUs: big slots keep the chunk count (post + notification + ack each) low
    p.add_argument("--slot-mib", type=int, default=256 if gpu else 32,
                   help="staging slot size (MiB); pack path 'descs' column counts chunks")
    p.add_argument("--slots", type=int, default=4, help="staging slots per pool")
    p.add_argument("--ucx-tls", default=None if gpu else "tcp,self,sm")
    p.add_argument("--net-devices", default=None if gpu else "lo")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch.set_num_threads for the pack path's CPU gathers (0: leave)")
    p.add_argument("--out", default=default_out)
    return p.parse_args(argv)


def make_cache(args: argparse.Namespace, num_blocks: int, device: torch.device,
               fill_seed: int | None) -> list[torch.Tensor]:
    """FlashAttention-style per-layer ``[2, num_blocks, block, heads, head]`` bf16 tensors.

    The source gets a cheap, block- and layer-unique pattern (a random row per layer plus
    the block index) instead of random numbers: generating 4 GiB of randoms takes longer
    than the benchmark.
    """
    shape = (2, num_blocks, args.block_size, args.kv_heads, args.head_dim)
    out = []
    gen = torch.Generator().manual_seed(fill_seed or 0)
    for _ in range(args.layers):
        t = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        if fill_seed is not None:
            row = torch.randint(-2**15, 2**15 - 1, (1, 1, int(np.prod(shape[2:]))),
                                dtype=torch.int16, generator=gen).to(device)
            blk = torch.arange(2 * num_blocks, dtype=torch.int16, device=device).view(2, num_blocks, 1)
            t.view(torch.int16).view(2, num_blocks, -1).copy_(row + blk)
        out.append(t)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Bench:
    """Two endpoints with a source and a destination cache, and the three strategies."""

    def __init__(self, args: argparse.Namespace, tokens: int, src_dev: torch.device,
                 dst_dev: torch.device) -> None:
        self.args = args
        self.src_dev, self.dst_dev = src_dev, dst_dev
        self.n = tokens // args.block_size
        self.src = make_cache(args, self.n, src_dev, fill_seed=args.seed + 1)
        self.dst = make_cache(args, self.n, dst_dev, fill_seed=None)
        self.ls = KvLayout.from_tensors(self.src, args.block_size)
        self.ld = KvLayout.from_tensors(self.dst, args.block_size)
        self.vs, self.vd = region_byte_views(self.src, self.ls), region_byte_views(self.dst, self.ld)
        self.nbytes = self.n * self.ls.bytes_per_block * self.ls.num_regions
        self.a = NixlEndpoint(f"bench-src-{tokens}", net_devices=args.net_devices, ucx_tls=args.ucx_tls)
        self.b = NixlEndpoint(f"bench-dst-{tokens}", net_devices=args.net_devices, ucx_tls=args.ucx_tls)
        self.a.register_layout(self.ls)
        self.b.register_layout(self.ld)
        slot = args.slot_mib << 20
        self.sa = StagedPeer(self.a, self.src, self.ls, slot_bytes=slot, num_slots=args.slots)
        self.sb = StagedPeer(self.b, self.dst, self.ld, slot_bytes=slot, num_slots=args.slots)
        self.a.add_peer(self.b.name, self.b.metadata())
        self.b.add_peer(self.a.name, self.a.metadata())
        self._xfer = 0

    def close(self) -> None:
        self.sa.close()
        self.sb.close()
        self.a.close()
        self.b.close()

    def ids(self, pattern: str) -> tuple[np.ndarray, np.ndarray]:
        if pattern == "contiguous":
            return np.arange(self.n), np.arange(self.n)
        rng = np.random.default_rng(self.args.seed)
        return rng.permutation(self.n), rng.permutation(self.n)

    def run_once(self, op: str, strategy: str, sids: np.ndarray, dids: np.ndarray) -> dict[str, Any]:
        """One timed transfer; returns ms, descriptors and plan time."""
        t_out = self.args.timeout
        self._xfer += 1
        xid = f"bench{self._xfer}"
        sync(self.src_dev)
        sync(self.dst_dev)
        t0 = time.perf_counter()
        descs, plan_ms = 0, 0.0
        if strategy == "pack":
            if op == "WRITE":
                self.sa.send(self.b.name, self.sb.info(), sids, dids, xid, timeout_s=t_out,
                             idle=self.b.poll_notifs)
                self.sb.wait_complete(xid, timeout_s=t_out)
            else:  # staged READ: B asks A to pack and push
                self.sb.request_pull(self.a.name, sids, dids, xid)
                deadline = time.monotonic() + t_out
                while not self.sa.serve_pulls(timeout_s=t_out, idle=self.b.poll_notifs):
                    if time.monotonic() > deadline:
                        raise TimeoutError("pull request never arrived")
                    self.a.poll_notifs()
                    time.sleep(20e-6)
                self.sb.wait_complete(xid, timeout_s=t_out)
            descs = len(plan_tiles(len(sids), self.ls.num_regions, self.ls.bytes_per_block,
                                   self.sa.send_pool.slot_bytes))
        else:
            coalesce = strategy == "runs"
            if op == "WRITE":
                plan = plan_transfer(self.ls, sids, self.ld, dids, op="WRITE", coalesce=coalesce)
                plan_ms = (time.perf_counter() - t0) * 1e3
                x = self.a.write(plan, self.b.name, xid.encode())
                self.a.wait(x, t_out, idle=self.b.poll_notifs)
            else:
                plan = plan_transfer(self.ld, dids, self.ls, sids, op="READ", coalesce=coalesce)
                plan_ms = (time.perf_counter() - t0) * 1e3
                x = self.b.read(plan, self.a.name, xid.encode())
                self.b.wait(x, t_out, idle=self.a.poll_notifs)
            descs = plan.num_descs
        sync(self.dst_dev)
        ms = (time.perf_counter() - t0) * 1e3
        self.a.poll_notifs()
        self.b.poll_notifs()
        return {"ms": ms, "num_descs": descs, "plan_ms": plan_ms}

    def verify(self, sids: np.ndarray, dids: np.ndarray) -> bool:
        """Every destination block equals its source block (region by region)."""
        si = torch.from_numpy(sids).to(self.src_dev)
        di = torch.from_numpy(dids).to(self.dst_dev)
        # compare as integers: the float container of the copy word has NaN bit patterns
        return all(torch.equal(vd.index_select(0, di).to(self.src_dev).view(torch.int64),
                               vs.index_select(0, si).view(torch.int64))
                   for vs, vd in zip(self.vs, self.vd))

    def clear_dst(self) -> None:
        for t in self.dst:
            t.zero_()
        sync(self.dst_dev)

    def baseline(self) -> float:
        """Plain copy of the same bytes per layer tensor, median ms.

        GPUs: ``dst.copy_(src)`` (a peer copy across devices). Host: ``np.copyto`` (one
        single-threaded memcpy; torch's 2-thread CPU copy measured 3× slower and erratic
        on a shared 2-core VM).
        """
        times = []
        for _ in range(self.args.warmup + self.args.iters):
            sync(self.src_dev)
            sync(self.dst_dev)
            t0 = time.perf_counter()
            for s, d in zip(self.src, self.dst):
                if s.is_cuda or d.is_cuda:
                    d.copy_(s)
                else:  # one memcpy per tensor: torch's multi-threaded CPU copy is noisy
                    np.copyto(d.view(torch.int16).numpy(), s.view(torch.int16).numpy())
            sync(self.dst_dev)
            sync(self.src_dev)
            times.append((time.perf_counter() - t0) * 1e3)
        # compare raw bits: the bf16 pattern contains NaNs, which never compare equal
        assert all(torch.equal(s.view(torch.int16), d.to(self.src_dev).view(torch.int16))
                   for s, d in zip(self.src[:2], self.dst[:2]))
        return statistics.median(times[self.args.warmup:])


def run_suite(args: argparse.Namespace, tokens: int, src_dev: torch.device,
              dst_dev: torch.device, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    bench = Bench(args, tokens, src_dev, dst_dev)
    rows: list[dict[str, Any]] = []
    try:
        base_ms = bench.baseline()
        rows.append(_row(tokens, "COPY", "contiguous", "plain_copy", base_ms, bench.nbytes, 0, 0.0,
                         True, [base_ms]))
        log(_fmt(rows[-1]))
        for pattern in args.patterns.split(","):
            sids, dids = bench.ids(pattern)
            nruns = len(coalesce_runs(sids, dids)[0]) * bench.ls.num_regions
            policy = choose_strategy(nruns, bench.nbytes, device=src_dev.type)
            for op in args.ops.split(","):
                for strategy in args.strategies.split(","):
                    times, ok_all, plan_ms, descs = [], True, 0.0, 0
                    for i in range(args.warmup + args.iters):
                        bench.clear_dst()
                        r = bench.run_once(op, strategy, sids, dids)
                        ok_all &= bench.verify(sids, dids)
                        if i >= args.warmup:
                            times.append(r["ms"])
                            plan_ms, descs = r["plan_ms"], r["num_descs"]
                    row = _row(tokens, op, pattern, strategy, statistics.median(times), bench.nbytes,
                               descs, plan_ms, ok_all, times)
                    row["policy_choice"] = policy
                    rows.append(row)
                    log(_fmt(row))
                    if not ok_all:
                        raise SystemExit(f"verification FAILED: {row}")
    finally:
        bench.close()
        del bench
    return rows


def _row(tokens: int, op: str, pattern: str, strategy: str, ms: float, nbytes: int, descs: int,
         plan_ms: float, ok: bool, times: list[float]) -> dict[str, Any]:
    return {"tokens": tokens, "op": op, "pattern": pattern, "strategy": strategy,
            "ms": round(ms, 3), "gbps": round(nbytes / (ms / 1e3) / GB, 2), "nbytes": nbytes,
            "best_ms": round(min(times), 3) if times else round(ms, 3),
            "num_descs": descs, "plan_ms": round(plan_ms, 3), "verified": ok,
            "all_ms": [round(t, 3) for t in times]}


def _fmt(r: dict[str, Any]) -> str:
    return (f"{r['tokens']:>6} {r['op']:<5} {r['pattern']:<10} {r['strategy']:<10} "
            f"{r['ms']:>10.2f} ms {r['gbps']:>8.2f} GB/s (best {r['best_ms']:>8.2f} ms) "
            f"{r['num_descs']:>8} descs "
            f"plan {r['plan_ms']:>7.2f} ms  {'ok' if r['verified'] else 'FAIL'}")


def header() -> str:
    return (f"{'tokens':>6} {'op':<5} {'pattern':<10} {'strategy':<10} {'time':>13} "
            f"{'bandwidth':>13} {'descs':>14}")


def environment() -> dict[str, Any]:
    try:
        from importlib.metadata import version
        nixl_v = version("nixl")
    except Exception:  # noqa: BLE001
        nixl_v = "unknown"
    return {"python": platform.python_version(), "torch": torch.__version__, "nixl": nixl_v,
            "cpus": os.cpu_count(), "host": platform.node(),
            "ucx_tls": os.environ.get("UCX_TLS"), "ucx_net_devices": os.environ.get("UCX_NET_DEVICES")}


def write_json(path: str, args: argparse.Namespace, rows: list[dict[str, Any]], extra: dict[str, Any]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in vars(args).items() if k != "out"}
    out.write_text(json.dumps({"config": cfg, "environment": {**environment(), **extra},
                               "results": rows}, indent=2) + "\n")
    print(f"wrote {out}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv, default_out=str(REPO / "benchmarks/results/datapath_host.json"))
    cpu = torch.device("cpu")
    print(f"host memory, {args.layers} layers, {args.kv_heads} KV heads × {args.head_dim}, "
          f"{args.block_size}-token blocks")
    print(header())
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    rows: list[dict[str, Any]] = []
    for tokens in args.tokens:
        rows += run_suite(args, tokens, cpu, cpu)
    write_json(args.out, args, rows, {"device": "cpu"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
