"""The router ⇄ connector contract (kvbaton/params.py): what the router writes is what the
connector's scheduler reads."""

from __future__ import annotations

from kvbaton import params as P


def test_reuse_offer_round_trips_through_json_shaped_params() -> None:
    offer = P.ReuseOffer("conv:1", "d0", "lease-1", "ret-1", (4, 5), 32, 16, (b"\x01" * 32, b"\x02" * 32))
    d = P.prefill_request("t1", mode="push", reuse=offer)
    assert d == {P.VERSION: P.PARAMS_VERSION, P.DO_REMOTE_DECODE: True, P.DO_REMOTE_PREFILL: False, P.TRANSFER_ID: "t1",
                 P.TRANSFER_MODE: "push", P.REUSE: offer.to_params()}
    assert P.ReuseOffer.from_params(d[P.REUSE]) == offer


def test_an_incomplete_or_malformed_offer_is_no_offer() -> None:
    good = P.ReuseOffer("c", "d0", "l", "r", (1,), 16, 16, (b"\x00",)).to_params()
    for key in ("conversation_id", "engine_id", "lease_id", "retention_id"):
        assert P.ReuseOffer.from_params({**good, key: ""}) is None
    assert P.ReuseOffer.from_params({**good, "block_hashes": ["zz"]}) is None  # not hex
    assert P.ReuseOffer.from_params({**good, "block_ids": ["x"]}) is None
    assert P.ReuseOffer.from_params("nope") is None


def test_handoffs_name_the_keys_decode_reads() -> None:
    pull = P.pull_handoff("p0", [3, 4], 40, "t9")
    assert (pull[P.DO_REMOTE_PREFILL], pull[P.REMOTE_ENGINE_ID], pull[P.REMOTE_BLOCK_IDS],
            pull[P.REMOTE_NUM_TOKENS], pull[P.TRANSFER_MODE]) == (True, "p0", [3, 4], 40, "pull")
    assert P.decode_push_request("t9")[P.TRANSFER_MODE] == "push"
    assert P.push_handoff("p0", "t9") == {P.VERSION: P.PARAMS_VERSION, P.TRANSFER_ID: "t9", P.TRANSFER_MODE: "push", P.REMOTE_ENGINE_ID: "p0"}


def test_every_builder_writes_the_version_and_another_version_is_refused_by_name() -> None:
    built = [P.prefill_request("t"), P.decode_push_request("t"), P.pull_handoff("p0", [1], 16, "t"),
             P.push_handoff("p0", "t")]
    assert all(d[P.VERSION] == P.PARAMS_VERSION and P.version_error(d) == "" for d in built)
    assert P.version_error({P.TRANSFER_ID: "t"}) == ""  # unversioned: version 1, accepted
    for other in (P.PARAMS_VERSION + 1, "1", None, True):
        err = P.version_error({P.VERSION: other, P.TRANSFER_ID: "t"})
        assert f"version {other!r} is not supported" in err and f"speaks version {P.PARAMS_VERSION}" in err
