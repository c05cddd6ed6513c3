"""vLLM's own push (``NixlPushConnector``) and bidirectional (``NixlConnector`` with
``bidirectional_kv_xfer``) P/D connectors on the sweep's engines: does each work here,
and with what TTFT? Run through ``benchmarks/sweep.py --baselines-only``.

Why a separate, sequential, strictly bounded step: both hung or froze in earlier runs on
this machine, so they can't share the open-loop sweep's client (one
wedged request would eat a run's budget and say little). Here every request is sent
alone, every leg and every whole request/turn has a timeout, a length stops after two
consecutive timeouts (the engines are wedged by then), and for each failure the new
warning/error lines of both engines' logs are kept, so "how it fails" is recorded.

There is no router for these connectors: this module is the proxy, talking HTTP to the
engines directly with the ``kv_transfer_params`` vLLM 0.32.0 expects:

- **push**: both legs at once (D must register its blocks before P finishes). P gets
  ``{"do_remote_decode": true}``, ``max_tokens`` 1. D gets ``{"do_remote_prefill": true,
  "remote_engine_id": <P's engine_id>, "remote_host", "remote_port": <P's NIXL side
  channel>, "tp_size": 1}``; D's scheduler turns that into a PUSH_REG notification to P,
  whose worker matches it to its finished request by request id with vLLM's random suffix
  stripped (``nixl/utils.get_base_request_id``), so both legs carry the same
  ``request_id``. P's engine id is fixed in the kv config (``PdStack(connector="nixl-push")``).
- **bidirectional**: turn 1 is plain pull (P ``{"do_remote_decode": true}``, then D with
  P's returned params). With ``bidirectional_kv_xfer`` D's ``request_finished`` keeps the
  request's blocks (``decoder_kv_blocks_ttl``, 480 s) and returns params describing them
  (``do_remote_decode: true, remote_block_ids, remote_engine_id, remote_num_tokens``...).
  Turn N+1 sends exactly those to P with the grown prompt (previous prompt + D's output
  ids + new tokens), and P's ``get_num_new_matched_tokens`` pulls ``remote_num_tokens``
  from D instead of recomputing them. vLLM returns ``kv_transfer_params`` only in
  non-streaming responses, so D's leg is non-streaming: the per-turn time is the whole
  turn (P leg + D's 32 tokens), an upper bound of TTFT. NIXL byte counters of both
  engines (``/metrics``) before/after each turn show whether P really read from D.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.pd_compare import VOCAB_HI, VOCAB_LO, _pct
from kvbaton.stack.pd_stack import PdStack, post_json, stream_request

T = TypeVar("T")
_INTERESTING = re.compile(r"ERROR|WARNING|Traceback|Exception|[Tt]imed? ?out|expired|fail", re.IGNORECASE)


def _log_offsets(stack: PdStack) -> dict[str, int]:
    """Current sizes of both engines' logs: where this request's lines start."""
    return {n: (s.log_path.stat().st_size if s is not None and s.log_path.exists() else 0)
            for n, s in (("prefill", stack.p), ("decode", stack.d))}


def _log_excerpt(stack: PdStack, since: dict[str, int], n: int = 6) -> dict[str, list[str]]:
    """The last ``n`` warning/error-looking lines each engine logged since ``since`` (or
    its last 2 lines if none): the evidence of how a request failed or hung."""
    out: dict[str, list[str]] = {}
    for name, srv in (("prefill", stack.p), ("decode", stack.d)):
        if srv is None or not srv.log_path.exists():
            continue
        with open(srv.log_path, "rb") as fh:
            fh.seek(since.get(name, 0))
            lines = fh.read().decode(errors="replace").splitlines()
        hits = [x for x in lines if _INTERESTING.search(x)]
        out[name] = [x[:300] for x in (hits[-n:] if hits else lines[-2:])]
    return out


def _nixl_counters(base_url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """``vllm:nixl_*`` counters/histogram sums of one engine, summed over label sets."""
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout_s) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:nixl") or not (name := line.split("{")[0].split(" ")[0]).endswith(
                ("_sum", "_count", "_total")):
            continue
        try:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        except ValueError:
            continue
    return out


def _delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: round(b[k] - a.get(k, 0.0), 6) for k in b if b[k] - a.get(k, 0.0)}


def _bounded(fn: Callable[[], T], timeout_s: float) -> T:
    """Run ``fn`` in a daemon-ish worker thread and give up after ``timeout_s`` (raises
    ``concurrent.futures.TimeoutError``). The thread itself ends by its socket timeouts."""
    ex = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return ex.submit(fn).result(timeout=timeout_s)
    finally:
        ex.shutdown(wait=False, cancel_futures=True)


def _completion(body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Non-streaming completion to an engine; raises on a non-200 answer."""
    status, raw = post_json(body.pop("_url"), body, timeout_s=timeout_s)
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {raw[:200]!r}")
    return json.loads(raw)


def _summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r["ttft_ms"] for r in records if r["status"] == "ok" and r.get("ttft_ms") is not None]
    return {"n": len(records), "ok": sum(r["status"] == "ok" for r in records),
            "timeout": sum(r["status"] == "timeout" for r in records),
            "error": sum(r["status"] == "error" for r in records),
            "skipped": sum(r["status"] == "skipped" for r in records),
            "ttft_ms_median": round(v, 1) if (v := _pct(ok, 0.5)) is not None else None,
            "ttft_ms_max": round(max(ok), 1) if ok else None}


def _start(stack: PdStack) -> dict[str, Any]:
    """Start ``stack`` (it stops itself on failure); its start time, or the error, which
    carries the failing engine's log tail."""
    t0 = time.monotonic()
    try:
        stack.start()
    except Exception as exc:  # noqa: BLE001 - a baseline that can't start is a result
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:3000]}
    return {"ok": True, "startup_s": round(time.monotonic() - t0, 1)}


# ---------------------------------------------------------------------- push

def run_push(model: Path, work: Path, lengths: list[int], n: int, output_tokens: int,
             timeout_s: float) -> dict[str, Any]:
    """``n`` requests one at a time per length through NixlPushConnector (both legs at once)."""
    res: dict[str, Any] = {"connector": "NixlPushConnector", "timeout_s": timeout_s, "runs": []}
    stack = PdStack(model, work / "nixl-push", connector="nixl-push", router_modes=(),
                    engine_args=["--no-enable-prefix-caching"], startup_timeout_s=300.0)
    res["stack"] = _start(stack)  # stops what it started if it fails
    if not res["stack"]["ok"]:
        return res
    try:
        assert stack.p is not None and stack.d is not None
        d_params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": stack.prefill_id,
                    "remote_host": "127.0.0.1", "remote_port": stack.side_channel_ports[stack.prefill_id],
                    "tp_size": 1}
        for length in lengths:
            rng = random.Random(length * 7 + 1)
            records: list[dict[str, Any]] = []
            consecutive_timeouts = 0
            for i in range(n):
                rid = f"bl-push-l{length}-{i}"
                if consecutive_timeouts >= 2:
                    records.append({"i": i, "request_id": rid, "status": "skipped",
                                    "error": "2 consecutive timeouts before: engines wedged"})
                    continue
                prompt = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(length)]
                common = {"model": "tiny", "prompt": prompt, "temperature": 0.0, "request_id": rid}
                pbody = {**common, "max_tokens": 1, "stream": False,
                         "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
                dbody = {**common, "max_tokens": output_tokens, "ignore_eos": True, "kv_transfer_params": d_params}
                since = _log_offsets(stack)
                rec: dict[str, Any] = {"i": i, "request_id": rid}
                t0 = time.perf_counter()
                ex = concurrent.futures.ThreadPoolExecutor(2)
                pf = ex.submit(_completion, {**pbody, "_url": f"{stack.p.base_url}/v1/completions"}, timeout_s)
                df = ex.submit(stream_request, f"{stack.d.base_url}/v1/completions", dbody, timeout_s)
                try:
                    r = df.result(timeout=timeout_s)
                    pf.result(timeout=max(0.1, timeout_s - (time.perf_counter() - t0)))
                    rec.update(ttft_ms=round(r.ttft_s * 1000, 1), e2e_ms=round(r.total_s * 1000, 1),
                               n_tokens=r.n_tokens)
                    rec["status"] = "ok" if r.n_tokens >= output_tokens and r.ttft_s >= 0 else "error"
                    if rec["status"] == "error":
                        rec["error"] = f"short stream: {r.n_tokens} of {output_tokens} tokens"
                    consecutive_timeouts = 0
                except concurrent.futures.TimeoutError:
                    rec.update(status="timeout", error=f"no complete answer within {timeout_s:.0f}s "
                               f"(prefill leg {'done' if pf.done() else 'pending'}, "
                               f"decode leg {'done' if df.done() else 'pending'})")
                    consecutive_timeouts += 1
                except Exception as exc:  # noqa: BLE001 - recorded
                    rec.update(status="error", error=f"{type(exc).__name__}: {exc}"[:300])
                    consecutive_timeouts = 0
                finally:
                    ex.shutdown(wait=False, cancel_futures=True)
                rec["wall_ms"] = round((time.perf_counter() - t0) * 1000, 1)
                if rec["status"] != "ok":
                    rec["log"] = _log_excerpt(stack, since)
                records.append(rec)
                print(f"  push len {length} #{i}: {rec['status']} "
                      f"{rec.get('ttft_ms', '')} {rec.get('error', '')[:100]}", flush=True)
            res["runs"].append({"length": length, "records": records, "summary": _summary(records)})
    finally:
        stack.stop()
    return res


# ---------------------------------------------------------------------- bidirectional

def run_bidir(model: Path, work: Path, length: int, turns: int, new_tokens: int, output_tokens: int,
              timeout_s: float) -> dict[str, Any]:
    """A ``turns``-turn conversation through NixlConnector with ``bidirectional_kv_xfer``."""
    res: dict[str, Any] = {"connector": "NixlConnector + bidirectional_kv_xfer", "timeout_s": timeout_s,
                           "turns": []}
    stack = PdStack(model, work / "nixl-bidir", connector="nixl-bidir", router_modes=(),
                    engine_args=["--no-enable-prefix-caching"], startup_timeout_s=300.0)
    res["stack"] = _start(stack)  # stops what it started if it fails
    if not res["stack"]["ok"]:
        return res
    try:
        assert stack.p is not None and stack.d is not None
        p_url, d_url = f"{stack.p.base_url}/v1/completions", f"{stack.d.base_url}/v1/completions"
        rng = random.Random(4242)
        tokens = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(length)]
        p_params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
        for turn in range(1, turns + 1):
            rid = f"bl-bidir-t{turn}"
            rec: dict[str, Any] = {"turn": turn, "request_id": rid, "prompt_tokens": len(tokens),
                                   "p_kv_transfer_params_in": {k: v for k, v in p_params.items()
                                                               if k != "remote_block_ids"}}
            since = _log_offsets(stack)
            c0 = {"p": _nixl_counters(stack.p.base_url), "d": _nixl_counters(stack.d.base_url)}
            t0 = time.perf_counter()
            legs: dict[str, float] = {}

            def one_turn(rid: str = rid, tokens: list[int] = tokens, p_params: dict[str, Any] = p_params,
                         legs: dict[str, float] = legs, t0: float = t0) -> dict[str, Any]:
                """P leg, then D leg, each with what is left of the turn's budget."""
                pb = {"_url": p_url, "model": "tiny", "prompt": tokens, "max_tokens": 1, "temperature": 0.0,
                      "stream": False, "request_id": rid, "kv_transfer_params": p_params}
                pr = _completion(pb, timeout_s)
                legs["p_ms"] = (time.perf_counter() - t0) * 1000
                ktp = pr.get("kv_transfer_params")
                if not ktp:
                    raise RuntimeError("prefill returned no kv_transfer_params")
                db = {"_url": d_url, "model": "tiny", "prompt": tokens, "max_tokens": output_tokens,
                      "temperature": 0.0, "ignore_eos": True, "stream": False, "return_token_ids": True,
                      "request_id": rid, "kv_transfer_params": ktp}
                dr = _completion(db, max(1.0, timeout_s - (time.perf_counter() - t0)))
                legs["d_ms"] = (time.perf_counter() - t0) * 1000 - legs["p_ms"]
                return dr

            try:
                dr = _bounded(one_turn, timeout_s)
                out_ids = dr["choices"][0].get("token_ids") or []
                back = dr.get("kv_transfer_params") or {}
                rec.update(status="ok", ttft_ms=round((time.perf_counter() - t0) * 1000, 1),
                           output_tokens=len(out_ids),
                           d_kv_transfer_params_out={k: v for k, v in back.items() if k != "remote_block_ids"})
                if turn < turns and not back.get("remote_block_ids"):
                    rec["note"] = "decode returned no retained blocks: next turn cannot read back"
                p_params = back if back else {"do_remote_decode": True, "do_remote_prefill": False}
                tokens = tokens + list(out_ids) + [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(new_tokens)]
            except concurrent.futures.TimeoutError:
                rec.update(status="timeout", error=f"turn not done within {timeout_s:.0f}s "
                           f"({'prefill leg done, decode pending' if 'p_ms' in legs else 'prefill leg pending'})")
            except Exception as exc:  # noqa: BLE001 - recorded
                rec.update(status="error", error=f"{type(exc).__name__}: {exc}"[:300])
            rec.update({k: round(v, 1) for k, v in legs.items()})
            rec["wall_ms"] = round((time.perf_counter() - t0) * 1000, 1)
            rec["nixl_counters_delta"] = {"prefill": _delta(c0["p"], _nixl_counters(stack.p.base_url)),
                                          "decode": _delta(c0["d"], _nixl_counters(stack.d.base_url))}
            if rec["status"] != "ok":
                rec["log"] = _log_excerpt(stack, since)
            res["turns"].append(rec)
            print(f"  bidir turn {turn} ({rec['prompt_tokens']} tok): {rec['status']} "
                  f"{rec.get('ttft_ms', '')} {rec.get('error', '')[:100]}", flush=True)
            if rec["status"] != "ok":
                break  # the conversation can't go on without this turn's output
    finally:
        stack.stop()
    return res


def run_baselines(model: Path, work: Path, out: Path, meta: dict[str, Any], *, push_lengths: list[int],
                  push_n: int, push_timeout_s: float, bidir_length: int, bidir_turns: int,
                  bidir_timeout_s: float, output_tokens: int) -> dict[str, Any]:
    """Push, then bidirectional (never both stacks at once: idle NIXL engines burn cores)."""
    t0 = time.monotonic()
    doc: dict[str, Any] = {"benchmark": "vllm_baselines", "meta": meta, "output_tokens": output_tokens}
    print("NixlPushConnector:", flush=True)
    doc["push"] = run_push(model, work, push_lengths, push_n, output_tokens, push_timeout_s)
    print("NixlConnector + bidirectional_kv_xfer:", flush=True)
    doc["bidir"] = run_bidir(model, work, bidir_length, bidir_turns, 128, output_tokens, bidir_timeout_s)
    doc["runtime_s"] = round(time.monotonic() - t0, 1)
    doc["workdir"] = str(work)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def print_baselines(doc: dict[str, Any]) -> None:
    """One line per push length and per bidirectional turn."""
    push, bidir = doc["push"], doc["bidir"]
    if not push.get("stack", {}).get("ok"):
        print(f"push: stack failed: {push.get('stack', {}).get('error', '')[:300]}")
    for run in push["runs"]:
        s = run["summary"]
        print(f"push  len {run['length']:>5}: ok {s['ok']}/{s['n']}, timeout {s['timeout']}, error {s['error']}, "
              f"skipped {s['skipped']}; TTFT median {s['ttft_ms_median']} ms")
    if not bidir.get("stack", {}).get("ok"):
        print(f"bidir: stack failed: {bidir.get('stack', {}).get('error', '')[:300]}")
    for t in bidir["turns"]:
        print(f"bidir turn {t['turn']} ({t['prompt_tokens']} tok): {t['status']}, turn {t.get('ttft_ms')} ms "
              f"(P {t.get('p_ms')} ms), P nixl delta {t['nixl_counters_delta']['prefill']}")
