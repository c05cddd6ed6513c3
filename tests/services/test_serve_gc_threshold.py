"""``kvbaton serve`` sets the collector's thresholds (``--gc-threshold``, default
``gc_policy.SERVE_THRESHOLD``; services/gc_policy.py says why); planes built in-process
(the tests' own) leave their process's collector alone."""

from __future__ import annotations

import asyncio
import gc
import signal

import pytest

from kvbaton import cli
from kvbaton.services import gc_policy
from kvbaton.services import server as server_mod
from kvbaton.services.server import ControlPlane, ServerConfig


@pytest.fixture
def restore_gc():
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)
    gc_policy.uninstall()
    gc.unfreeze()


async def test_serve_sets_the_threshold_before_it_listens(restore_gc, monkeypatch):
    listening = asyncio.Event()
    seen: list[tuple[int, int, int]] = []
    install = gc_policy.install

    def installed(loop, **kw) -> None:  # serve() installs the policy once the plane is up
        seen.append(gc.get_threshold())
        install(loop, **kw)
        listening.set()

    monkeypatch.setattr(gc_policy, "install", installed)
    gc.set_threshold(*gc_policy.CPYTHON_THRESHOLD)
    task = asyncio.create_task(server_mod.serve(ServerConfig(address="127.0.0.1:0", insecure=True, grace_s=0.5,
                                                             gc_threshold=(12_345, 6, 7))))
    try:
        await asyncio.wait_for(listening.wait(), 20)
        assert seen == [(12_345, 6, 7)]
        assert gc.get_threshold() == (12_345, 6, 7)
    finally:
        # serve() stops on SIGTERM (its handlers are on this loop, added in the same turn
        # as the policy); cancelling instead would leave the plane running.
        if not task.done():
            signal.raise_signal(signal.SIGTERM)
        await asyncio.wait_for(task, 20)


async def test_a_plane_built_in_process_leaves_the_collector_alone(restore_gc):
    gc.set_threshold(*gc_policy.CPYTHON_THRESHOLD)
    plane = ControlPlane(ServerConfig(address="127.0.0.1:0", insecure=True, grace_s=0.5, gc_threshold=(9_999, 9, 9)))
    await plane.start()
    try:
        assert gc.get_threshold() == gc_policy.CPYTHON_THRESHOLD
    finally:
        await plane.stop()


def test_the_flag_reaches_the_config(monkeypatch):
    configs: list[ServerConfig] = []

    async def fake_serve(config: ServerConfig) -> None:
        configs.append(config)

    monkeypatch.setattr(server_mod, "serve", fake_serve)
    parser = cli.build_parser()
    for argv, want in ((["serve", "--gc-threshold", "20000,20,5"], (20_000, 20, 5)),
                       (["serve"], gc_policy.SERVE_THRESHOLD)):
        args = parser.parse_args([*argv, "--insecure", "--event-loop", "asyncio"])
        assert args.func(args) == 0
        assert configs.pop().gc_threshold == want


@pytest.mark.parametrize("bad", ["700,10", "700,10,10,1", "0,10,10", "700,-1,10", "seven,10,10", ""])
def test_a_bad_threshold_is_refused_up_front(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["serve", "--gc-threshold", bad])
    assert exc.value.code == 2
    assert "three whole numbers >= 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="three whole numbers"):
        gc_policy.set_threshold(tuple(int(x) for x in ("0", "1", "1")))  # type: ignore[arg-type]
