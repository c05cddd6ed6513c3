"""The generated model's named shapes: what a benchmark that picks one relies on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbaton.tinymodel import SHAPES, TinyModelSpec, ensure_tiny_model, spec_for_shape


def _kv_bytes_per_token(s: TinyModelSpec) -> int:
    head_dim = s.hidden_size // s.num_attention_heads
    return s.num_hidden_layers * 2 * s.num_key_value_heads * head_dim * 4  # float32


def _prefill_flop_per_token(s: TinyModelSpec) -> int:
    head_dim = s.hidden_size // s.num_attention_heads
    kv = s.num_key_value_heads * head_dim
    attn = 2 * s.hidden_size * s.hidden_size + 2 * s.hidden_size * kv  # q, o + k, v projections
    mlp = 3 * s.hidden_size * s.intermediate_size
    return 2 * s.num_hidden_layers * (attn + mlp)


def test_tiny_is_the_tests_default() -> None:
    assert spec_for_shape("tiny") == TinyModelSpec()


def test_compute_keeps_kv_bytes_per_token_and_costs_far_more_to_prefill() -> None:
    tiny, compute = spec_for_shape("tiny"), spec_for_shape("compute")
    # Same KV per token: the prefill caches' sizing (--prefill-kv-mib) means the same tokens.
    assert _kv_bytes_per_token(compute) == _kv_bytes_per_token(tiny) == 2048
    assert _prefill_flop_per_token(compute) > 12 * _prefill_flop_per_token(tiny)


def test_overrides_and_unknown_shape() -> None:
    assert spec_for_shape("compute", seed=3).seed == 3
    with pytest.raises(ValueError, match="unknown model shape 'huge'"):
        spec_for_shape("huge")
    assert set(SHAPES) >= {"tiny", "compute"}


def test_the_compute_shape_builds_with_the_geometry_vllm_reads(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = ensure_tiny_model(tmp_path / "m", spec_for_shape("compute"))
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"]) == (4, 512, 1)
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64
    # The stamp names the shape's spec: asking for tiny in the same place rebuilds, not reuses.
    assert "\"hidden_size\": 512" in (out / "kvbaton_tinymodel.json").read_text()
