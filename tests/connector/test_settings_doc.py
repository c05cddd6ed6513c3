"""Every connector setting is documented in docs/connector-settings.md, and vice versa."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvbaton.connector.metadata import KvbatonSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "connector-settings.md"


def test_settings_and_their_documentation_agree() -> None:
    fields = {f.name for f in dataclasses.fields(KvbatonSettings)}
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", DOC.read_text(), flags=re.M))
    assert fields - documented == set(), "settings missing from docs/connector-settings.md"
    assert documented - fields == set(), "docs/connector-settings.md lists settings that do not exist"


def _other_value(f: dataclasses.Field) -> object:
    """A valid value different from the field's default, by the default's type."""
    d = f.default
    if f.name == "mode":
        return "push"
    if f.name == "staging":
        return "always"
    if f.name == "serve_role":
        return "decode"
    if f.name == "nixl_backend":
        return "libfabric"
    if isinstance(d, bool):
        return not d
    if isinstance(d, int):
        return d + 7
    if isinstance(d, float):
        return d + 1.5
    return f"x-{f.name}"


def test_every_setting_is_read_from_the_extra_config() -> None:
    """A key that from_vllm forgets to read would be silently ignored by every engine."""
    import types

    fields = [f for f in dataclasses.fields(KvbatonSettings) if f.name != "control_plane"]
    values = {f.name: _other_value(f) for f in fields}
    values["control_plane"] = "cp:1"
    ktc = types.SimpleNamespace(engine_id="", get_from_extra_config=lambda k, default=None: values.get(k, default))
    settings = KvbatonSettings.from_vllm(ktc)
    for f in fields:
        assert getattr(settings, f.name) == values[f.name], f.name


def test_doc_is_generated_from_the_table() -> None:
    """docs/connector-settings.md is rendered from the one settings table (no hand edits)."""
    from kvbaton.connector.settings import render_doc

    assert DOC.read_text() == render_doc(), "run: python -m kvbaton.connector.settings --write-doc"


@pytest.mark.parametrize("raw,expected", [("false", False), ("False", False), ("0", False), ("no", False),
                                          ("true", True), ("1", True), (True, True), (False, False), (0, False)])
def test_booleans_parse_strictly(raw: object, expected: bool) -> None:
    """``retain: "false"`` used to turn retention on (``bool("false")``)."""
    import types

    values = {"control_plane": "cp:1", "engine_id": "e", "retain": raw, "verify_kv": raw}
    ktc = types.SimpleNamespace(engine_id="", get_from_extra_config=lambda k, default=None: values.get(k, default))
    s = KvbatonSettings.from_vllm(ktc)
    assert (s.retain, s.verify_kv) == (expected, expected)


@pytest.mark.parametrize("key,raw", [("retain", "maybe"), ("verify_kv", 2), ("timeout_s", "soon"),
                                     ("mode", "sideways"), ("staging", "sometimes")])
def test_bad_values_are_refused_naming_the_key(key: str, raw: object) -> None:
    import types

    values = {"control_plane": "cp:1", "engine_id": "e", key: raw}
    ktc = types.SimpleNamespace(engine_id="", get_from_extra_config=lambda k, default=None: values.get(k, default))
    with pytest.raises(ValueError, match=key):
        KvbatonSettings.from_vllm(ktc)
