"""Shared fixtures: a real control plane (in-process gRPC server on a loopback port)."""

from __future__ import annotations

import pytest

from kvbaton import logs

logs.configure("WARNING")


def pytest_collection_modifyitems(config, items):
    # Long end-to-end tests last, so quick failures show first.
    items.sort(key=lambda it: 1 if it.get_closest_marker("vllm") else 0)


@pytest.fixture(scope="session")
def etcd_cluster():
    """One real etcd member on loopback for the whole session (stopped by pid at the end)."""
    from kvbaton.stack.etcd_cluster import EtcdCluster, find_etcd

    if find_etcd() is None:
        pytest.skip("etcd binary not found (scripts/test.sh installs Debian's etcd-server)")
    cluster = EtcdCluster(1).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(autouse=True)
def _dump_tasks_if_stuck():
    """If a test hangs, print every asyncio task's stack before pytest-timeout fires:
    the thread dump alone only shows the idle event loop."""
    import asyncio
    import gc
    import sys
    import threading

    done = threading.Event()

    def watchdog() -> None:
        if done.wait(90):
            return
        loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop) and o.is_running()]
        for loop in loops:
            def dump(loop=loop) -> None:
                for task in asyncio.all_tasks(loop):
                    print(f"--- stuck task {task.get_name()}: {task.get_coro()}", file=sys.stderr)
                    task.print_stack(file=sys.stderr)
            loop.call_soon_threadsafe(dump)

    threading.Thread(target=watchdog, daemon=True, name="stuck-test-watchdog").start()
    yield
    done.set()
