"""What ``verify_kv`` costs: fingerprint throughput, and TTFT of a reuse turn on vs off.

    flock /tmp/kvbaton-bench.lock .venv/bin/python benchmarks/verify_cost.py [--skip-vllm]

1. **Throughput** (no vLLM): a host KV cache shaped like a Llama-3-8B engine's (32 layers,
   8 KV heads, head 128, bf16, 16-token blocks: 64 KiB per layer-block, 2 MiB per block
   over all layers; 768 MiB cache), fingerprinting 256 scattered blocks (512 MiB) with each
   algorithm, on the connector's own background thread (``Fingerprinter.submit``), best
   of 3. Also the tiny test model's geometry (2 layers x 128 KiB).
2. **TTFT** (real vLLM, tiny model): the same two-turn conversation (3,000-token first
   prompt, 40 output tokens, 200 new tokens; turn 2 READs ~3,000 tokens = 23 blocks from
   decode) through the pull router, on a stack with ``verify_kv`` off and then on; one
   run each (this box is shared and has 2 cores: treat differences of a few ms as noise).

Prints a table and writes ``benchmarks/results/verify_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch

from kvbaton.connector.transfer.geometry import KvLayout
from kvbaton.connector.transfer.integrity import ALG_CRC32, ALG_TORCH64, Fingerprinter


def throughput(layers: int, layer_block_bytes: int, cache_blocks: int, sample: int, tokens: int,
               label: str) -> list[dict[str, Any]]:
    cache = torch.empty(layers * cache_blocks * layer_block_bytes, dtype=torch.uint8)
    cache.random_(0, 256)
    base = cache.data_ptr()
    layout = KvLayout(tuple(base + i * cache_blocks * layer_block_bytes for i in range(layers)),
                      layer_block_bytes, cache_blocks, tokens, "bfloat16")
    ids = random.Random(1).sample(range(cache_blocks), sample)
    nbytes = sample * layers * layer_block_bytes
    out = []
    for alg in (ALG_CRC32, ALG_TORCH64):
        fp = Fingerprinter(layout, [cache], alg)
        fp.submit(ids[:2]).result()  # warm (torch64 builds its views and weights once)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            fp.submit(ids).result()
            best = min(best, time.perf_counter() - t0)
        fp.close()
        out.append({"geometry": label, "alg": alg, "blocks": sample, "bytes": nbytes, "seconds": round(best, 4),
                    "gb_per_s": round(nbytes / best / 1e9, 2), "ms_per_block": round(best / sample * 1e3, 3)})
    del cache
    return out


def ttft_pair(first_tokens: int, new_tokens: int) -> list[dict[str, Any]]:
    from kvbaton.stack.pd_stack import PdStack, post_json, stream_request
    from kvbaton.tinymodel import ensure_tiny_model

    model = ensure_tiny_model(Path(os.environ.get("KVBATON_TINY_MODEL", "/tmp/kvbaton-tiny-model")))
    rnd = random.Random(5)
    prompt = [rnd.randrange(10, 4000) for _ in range(first_tokens)]
    extra_new = [rnd.randrange(10, 4000) for _ in range(new_tokens)]
    rows = []
    for verify in (False, True):
        work = Path(tempfile.mkdtemp(prefix=f"verify-cost-{int(verify)}-"))
        with PdStack(model, work, router_modes=("pull",), timeout_s=20,
                     extra_config={"verify_kv": verify, "lease_ttl_s": 60.0},
                     prefill_args=["--no-enable-prefix-caching"], router_control_plane=True) as s:
            conv = f"bench-{int(verify)}"
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0.0, "ignore_eos": True,
                    "return_token_ids": True, "conversation_id": conv}
            status, raw = post_json(f"{s.routers['pull']}/v1/completions", body, 300)
            assert status == 200, raw[:300]
            got = json.loads(raw)["choices"][0]["token_ids"]
            time.sleep(1.0)  # decode registers the retention and takes the lease
            prompt2 = prompt + got + extra_new
            res = stream_request(f"{s.routers['pull']}/v1/completions",
                                 {**body, "prompt": prompt2, "max_tokens": 16}, 300)
            time.sleep(0.5)
            reads = s.events("p0", "reuse_read")
            ver = s.events("p0", "kv_verify")
            assert len(reads) == 1, f"turn 2 did not read its history from decode: {reads}"
            rows.append({"verify_kv": verify, "ttft_s": round(res.ttft_s, 4),
                         "read_blocks": reads[0]["num_blocks"], "read_s": reads[0]["duration_s"],
                         "verify_s": ver[0]["verify_s"] if ver else None,
                         "verified": [v["result"] for v in ver]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-vllm", action="store_true", help="throughput only")
    args = ap.parse_args()
    thr = throughput(32, 64 * 1024, 384, 256, 16, "llama-8b-like bf16, 16-token blocks")
    thr += throughput(2, 128 * 1024, 256, 128, 128, "tiny test model f32, 128-token blocks")
    print(f"{'geometry':42} {'alg':8} {'blocks':>6} {'MiB':>6} {'ms':>8} {'GB/s':>6} {'ms/block':>8}")
    for r in thr:
        print(f"{r['geometry']:42} {r['alg']:8} {r['blocks']:6d} {r['bytes'] / 2**20:6.0f} "
              f"{r['seconds'] * 1e3:8.1f} {r['gb_per_s']:6.2f} {r['ms_per_block']:8.3f}")
    ttft: list[dict[str, Any]] = []
    if not args.skip_vllm:
        ttft = ttft_pair(3000, 200)
        for r in ttft:
            verify = "-" if r["verify_s"] is None else f"{r['verify_s'] * 1e3:.1f} ms"
            print(f"reuse turn TTFT verify_kv={str(r['verify_kv']).lower():5}: {r['ttft_s'] * 1e3:7.1f} ms "
                  f"(READ {r['read_blocks']} blocks in {r['read_s'] * 1e3:.1f} ms, landed->verified {verify}, "
                  f"{r['verified']})")
    out = ROOT / "benchmarks" / "results" / "verify_cost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
                               "throughput": thr, "reuse_ttft": ttft, "t": time.time()}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
