"""Data-path benchmark on CUDA tensors: NIXL WRITE/READ of a KV cache between GPUs.

Same cases as ``datapath.py`` (per-block descriptors, coalesced runs, staged pack;
contiguous and fragmented ids; WRITE and READ; every run verified) for 1k/4k/16k tokens
of a Qwen3-32B-shaped cache, source on ``cuda:0`` and destination on ``cuda:1`` when two
GPUs are visible (else both on ``cuda:0``), beside a raw peer copy ``dst.copy_(src)``.

    python benchmarks/datapath_gpu.py                    # 1k, 4k, 16k tokens
    python benchmarks/datapath_gpu.py --tokens 4096 --iters 5

Needs only torch, numpy and nixl (e.g. ``nixl`` + ``nixl-cu13`` wheels); the connector is
imported from this repository via sys.path, nothing is installed. Exits 0 with
"skipped: no CUDA" where there is no GPU. UCX picks its transports unless ``--ucx-tls`` is
given (then include ``cuda_copy,cuda_ipc``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402  (torch before nixl: it must own the CUDA context first)

import datapath  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    if not torch.cuda.is_available():
        print("skipped: no CUDA")
        return 0
    try:
        import nixl  # noqa: F401
    except ImportError as e:
        print(f"error: nixl is not importable ({e}); install nixl + nixl-cu13 wheels with --no-deps")
        return 2
    args = datapath.parse_args(argv, str(datapath.REPO / "benchmarks/results/datapath_gpu.json"),
                               gpu=True)
    ngpu = torch.cuda.device_count()
    src, dst = torch.device("cuda:0"), torch.device("cuda:1" if ngpu > 1 else "cuda:0")
    if ngpu > 1:
        torch.cuda.set_device(src)
        can = torch.cuda.can_device_access_peer(0, 1)
        print(f"peer access cuda:0 → cuda:1: {can}")
    names = [torch.cuda.get_device_name(i) for i in range(ngpu)]
    print(f"{ngpu} GPU(s) {names}; {src} → {dst}; {args.layers} layers, {args.kv_heads} KV heads"
          f" × {args.head_dim}, {args.block_size}-token blocks")
    print(datapath.header())
    rows: list[dict[str, Any]] = []
    for tokens in args.tokens:
        rows += datapath.run_suite(args, tokens, src, dst)
        torch.cuda.empty_cache()
    datapath.write_json(args.out, args, rows, {"device": "cuda", "gpus": names,
                                               "src": str(src), "dst": str(dst),
                                               "cuda": torch.version.cuda})
    return 0


if __name__ == "__main__":
    sys.exit(main())
