"""Heterogeneous-TP KV transfer on CUDA tensors: every rank its own process and NIXL agent,
head slices placed by ``connector/transfer/tp_mapping.py``, every landed byte checked.

For each (prefill TP, decode TP) pair it builds one process per rank (UCX will not use
CUDA IPC between two agents of one process), each holding its rank's share of a KV cache
laid out head-major per block (``[blocks, heads_of_rank, block_size, 2*head_dim]`` per
layer, as vLLM's CPU backend and HND layouts keep it), fills the owner (prefill) ranks with
values that depend on (layer, request block, global head), and moves one request's blocks
(random, distinct block ids on both sides):

* ``push`` — every owner rank WRITEs its slices into the receiver ranks that hold those
  heads (``TpMapping.out_of`` / ``descs``); a receiver is done when every one of its
  ``writers_of`` notifications came;
* ``pull`` — every receiver rank READs its slices from the owners (``TpMapping.into``).

Each receiver rank then compares what landed with the values expected for its heads
(``torch.equal`` on every layer, and an order-sensitive checksum that goes into the
results), and bytes moved per rank must add up to the request's KV. Time is wall clock
from the start signal to the last receiver done (``time.perf_counter``: one clock for all
processes on Linux), median of ``--iters``; GB/s is the request's KV bytes over that.
Ranks go round-robin over the visible GPUs (prefill ranks first), so with one GPU every
rank shares it.

    python benchmarks/tp_mapping_gpu.py --out benchmarks/results/tp_mapping_gpu.json
    python benchmarks/tp_mapping_gpu.py --smoke

Needs torch and nixl (``nixl`` + ``nixl-cu13`` wheels); the repository is put on
``sys.path`` (nothing installed). Exits 0 with "skipped: no CUDA" without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np
import torch

from connector.transfer.tp_mapping import TpMapping, compute_tp_mapping
from kvbaton.kvgeometry import EngineKv

GB = 1e9


def _imports() -> tuple[Any, Any, Any]:
    """KvLayout, TransferPlan, NixlEndpoint wherever this checkout keeps them."""
    try:
        from connector.transfer.descriptors import TransferPlan
        from connector.transfer.geometry import KvLayout
        from connector.transfer.nixl_agent import NixlEndpoint
    except ImportError:
        from connector.descriptors import TransferPlan
        from connector.geometry import KvLayout
        from connector.nixl_agent import NixlEndpoint
    return KvLayout, TransferPlan, NixlEndpoint


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", nargs="+", default=["2x1", "1x2", "2x2", "4x2", "2x4"],
                   help="prefill TP x decode TP")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one iteration")
    p.add_argument("--cpu", action="store_true", help="host memory, every rank on the CPU (checks the script)")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if a.smoke:
        a.tokens, a.layers, a.iters, a.pairs = 256, 2, 1, ["2x1", "1x2"]
    return a


def engine_kv(a: argparse.Namespace, tp: int) -> EngineKv:
    per = max(a.kv_heads // tp, 1)
    return EngineKv(tp_size=tp, tokens_per_block=a.block_size,
                    bytes_per_block=per * a.block_size * 2 * a.head_dim * 2, num_regions=a.layers,
                    dtype="bfloat16", layout="block_major", total_kv_heads=a.kv_heads, head_major=True)


def expected_head(a: argparse.Namespace, layer: int, head: int, n: int, device: torch.device) -> torch.Tensor:
    """The values of one global head of one layer for the request's n blocks (deterministic)."""
    g = torch.Generator(device=device)
    g.manual_seed(1_000_003 * layer + head + 17)
    return torch.randn((n, a.block_size, 2 * a.head_dim), generator=g, device=device, dtype=torch.float32
                       ).to(torch.bfloat16)


def ep_device(layout: Any) -> str:
    return str(layout.device)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def checksum(t: torch.Tensor) -> int:
    """Order-sensitive checksum of a tensor's bytes."""
    x = t.contiguous().view(torch.int16).to(torch.int64).flatten()
    w = torch.arange(1, x.numel() + 1, device=x.device, dtype=torch.int64) % 1_000_003
    return int((x * w).sum().item())


# ---------------------------------------------------------------------- one rank
def rank_main(role: str, rank: int, a: argparse.Namespace, pair: tuple[int, int], dev_index: int,
              src_ids: list[int], dst_ids: list[int], conn: Any) -> None:
    KvLayout, TransferPlan, NixlEndpoint = _imports()
    if dev_index >= 0:
        torch.cuda.set_device(dev_index)
        dev = torch.device(f"cuda:{dev_index}")
    else:  # --cpu: host memory over UCX on loopback (a check of the script, not a number)
        dev = torch.device("cpu")
    p_tp, d_tp = pair
    m = compute_tp_mapping(engine_kv(a, p_tp), engine_kv(a, d_tp))
    me = m.src if role == "P" else m.dst
    heads = list(me.heads_of(rank))
    pool = 3 * len(src_ids)
    caches = [torch.zeros((pool, len(heads), a.block_size, 2 * a.head_dim), dtype=torch.bfloat16, device=dev)
              for _ in range(a.layers)]
    n = len(src_ids)
    if role == "P":
        idx = torch.tensor(src_ids, device=dev)
        for layer, c in enumerate(caches):
            for i, h in enumerate(heads):
                c[idx, i] = expected_head(a, layer, h, n, dev)
    _sync(dev.type)
    layout = KvLayout.from_tensors(caches, a.block_size, block_dim=0)
    ep = (NixlEndpoint(f"tp-{role}{rank}-{p_tp}x{d_tp}") if dev.type == "cuda" else
          NixlEndpoint(f"tp-{role}{rank}-{p_tp}x{d_tp}", net_devices="lo", ucx_tls="tcp,self,sm"))
    ep.register_layout(layout)
    conn.send((ep.name, ep.metadata(), layout.to_proto_fields()))
    peers: dict[tuple[str, int], tuple[str, Any]] = {}
    for key, (name, meta, fields) in conn.recv().items():
        if key != (role, rank):
            ep.add_peer(name, meta)
        peers[key] = (name, KvLayout.from_proto_fields(**fields))
    try:
        while True:
            while not conn.poll(0.0005):  # no progress thread: a passive agent must poll
                ep.poll_notifs()
            cmd, *rest = conn.recv()
            if cmd == "stop":
                break
            if cmd == "clear":
                if role == "D":
                    for c in caches:
                        c.zero_()
                    _sync(dev.type)
                conn.send("ok")
            elif cmd == "run":
                mode, tag = rest
                conn.send(_run(m, role, rank, mode, tag, ep, layout, peers, src_ids, dst_ids, TransferPlan, a))
            elif cmd == "verify":
                conn.send(_verify(a, caches, heads, dst_ids, dev))
    finally:
        ep.close()
        conn.close()


def _run(m: TpMapping, role: str, rank: int, mode: str, tag: str, ep: Any, layout: Any,
         peers: dict[tuple[str, int], tuple[str, Any]], src_ids: list[int], dst_ids: list[int],
         TransferPlan: Any, a: argparse.Namespace) -> tuple[float, int, int]:
    """This rank's part of one transfer: (perf_counter when done, bytes moved, descs)."""
    moved = descs = 0
    xfers = []
    if mode == "push" and role == "P":
        for piece in m.out_of(rank):
            peer, remote = peers[("D", piece.dst_rank)]
            loc, rem = m.descs(piece, layout, src_ids, remote, dst_ids)
            plan = TransferPlan(loc, rem, int(loc[:, 1].sum()), len(loc), layout.nixl_mem_type, remote.nixl_mem_type)
            xfers.append(ep.write(plan, peer, f"{tag}:{rank}".encode()))
            moved, descs = moved + plan.nbytes, descs + plan.num_descs
    elif mode == "pull" and role == "D":
        for piece in m.into(rank):
            peer, remote = peers[("P", piece.src_rank)]
            rem, loc = m.descs(piece, remote, src_ids, layout, dst_ids)
            plan = TransferPlan(loc, rem, int(loc[:, 1].sum()), len(loc), layout.nixl_mem_type, remote.nixl_mem_type)
            xfers.append(ep.read(plan, peer))
            moved, descs = moved + plan.nbytes, descs + plan.num_descs
    for x in xfers:
        ep.wait(x, a.timeout)  # releases it
    if mode == "push" and role == "D":
        for src in sorted({p.src_rank for p in m.into(rank)}):
            ep.wait_notif(peers[("P", src)][0], f"{tag}:{src}".encode(), timeout_s=a.timeout)
    _sync(ep_device(layout))
    return time.perf_counter(), moved, descs


def _verify(a: argparse.Namespace, caches: list[torch.Tensor], heads: list[int], dst_ids: list[int],
            dev: torch.device) -> tuple[bool, int, int]:
    """(every layer and head equal to the expected values, checksum landed, checksum expected)."""
    idx = torch.tensor(dst_ids, device=dev)
    ok, got_sum, want_sum = True, 0, 0
    for layer, c in enumerate(caches):
        got = c[idx]
        want = torch.stack([expected_head(a, layer, h, len(dst_ids), dev) for h in heads], dim=1)
        ok = ok and torch.equal(got, want)
        got_sum += checksum(got)
        want_sum += checksum(want)
    return ok, got_sum, want_sum


# ---------------------------------------------------------------------- one pair
def run_pair(a: argparse.Namespace, p_tp: int, d_tp: int, gpus: int) -> list[dict[str, Any]]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    m = compute_tp_mapping(engine_kv(a, p_tp), engine_kv(a, d_tp))
    n = a.tokens // a.block_size
    rng = np.random.default_rng(p_tp * 10 + d_tp)
    src_ids = rng.choice(3 * n, n, replace=False).tolist()
    dst_ids = rng.choice(3 * n, n, replace=False).tolist()
    ranks = [("P", r) for r in range(p_tp)] + [("D", r) for r in range(d_tp)]
    conns, procs, devs = {}, [], {}
    for i, key in enumerate(ranks):
        parent, child = ctx.Pipe()
        devs[key] = i % gpus if gpus else -1
        proc = ctx.Process(target=rank_main, args=(key[0], key[1], a, (p_tp, d_tp), devs[key], src_ids, dst_ids,
                                                   child), daemon=True)
        proc.start()
        conns[key], _ = parent, procs.append(proc)
    rows: list[dict[str, Any]] = []
    try:
        info = {key: conns[key].recv() for key in ranks}
        for key in ranks:
            conns[key].send(info)
        for mode in ("push", "pull"):
            times, verified = [], []
            per_rank: dict[str, int] = {}
            descs = 0
            for it in range(a.iters):
                for key in ranks:
                    conns[key].send(("clear",))
                for key in ranks:
                    conns[key].recv()
                t0 = time.perf_counter()
                for key in ranks:
                    conns[key].send(("run", mode, f"{mode}{it}"))
                res = {key: conns[key].recv() for key in ranks}
                times.append(max(t for t, _, _ in res.values()) - t0)
                per_rank = {f"{k[0]}{k[1]}": b for k, (_, b, _) in res.items() if b}
                descs = sum(d for _, _, d in res.values())
                for key in ranks:
                    if key[0] == "D":
                        conns[key].send(("verify",))
                verified = [conns[key].recv() for key in ranks if key[0] == "D"]
            total = m.request_bytes(n)
            ms = statistics.median(times) * 1e3
            ok = all(v[0] and v[1] == v[2] for v in verified) and sum(per_rank.values()) == total
            rows.append({
                "pair": f"P TP{p_tp} -> D TP{d_tp}", "mode": mode, "tokens": a.tokens, "layers": a.layers,
                "kv_heads": a.kv_heads, "head_dim": a.head_dim, "block_size": a.block_size,
                "request_bytes": total, "bytes_per_rank": per_rank, "descs": descs,
                "writer_ranks": list(m.writer_ranks), "writers_per_decode_rank": [m.writers_of(d) for d in range(d_tp)],
                "ms_median": round(ms, 3), "ms_all": [round(t * 1e3, 3) for t in times],
                "gb_s": round(total / (ms / 1e3) / GB, 2), "verified": ok,
                "checksums": [{"landed": v[1], "expected": v[2], "equal": v[0]} for v in verified],
                "gpus": sorted({devs[k] for k in ranks}),
            })
            print(f"{rows[-1]['pair']:>16} {mode:4}  {total / 2**20:8.1f} MiB  {ms:8.2f} ms  "
                  f"{rows[-1]['gb_s']:7.2f} GB/s  descs {descs:6d}  verified {ok}", flush=True)
    finally:
        for key in ranks:
            try:
                conns[key].send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for proc in procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
    return rows


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not a.cpu and not torch.cuda.is_available():
        print("skipped: no CUDA")
        return 0
    gpus = 0 if a.cpu else torch.cuda.device_count()
    rows = []
    for spec in a.pairs:
        p_tp, d_tp = (int(x) for x in spec.split("x"))
        rows.extend(run_pair(a, p_tp, d_tp, gpus))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    result = {"script": "benchmarks/tp_mapping_gpu.py", "argv": sys.argv[1:], "commit": commit or "unknown",
              "devices": [torch.cuda.get_device_name(i) for i in range(gpus)] or ["cpu"],
              "env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")}, "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
