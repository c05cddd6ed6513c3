"""services/api/eager.py: a session call runs inline until it first waits, and one that
waits is finished by a task with the semantics ``create_task`` would give it."""

from __future__ import annotations

import asyncio

import pytest

from kvbaton.services.api import eager


async def test_a_coroutine_that_never_waits_is_answered_inline():
    ran = []

    async def call() -> str:
        ran.append(1)
        return "done"

    done, value = eager.start(call())
    assert done and value == "done" and ran == [1]


async def test_an_error_before_any_wait_is_raised_by_start():
    async def call() -> None:
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        eager.start(call())


async def test_a_coroutine_that_waits_is_finished_by_its_task_with_the_futures_outcome():
    loop = asyncio.get_running_loop()
    first, second = loop.create_future(), loop.create_future()
    seen = []

    async def call() -> str:
        seen.append(await first)
        await asyncio.sleep(0)  # a bare yield is one loop turn
        try:
            await second
        except KeyError as exc:  # the future's exception is raised inside the coroutine
            seen.append(repr(exc))
        return "finished"

    done, pending = eager.start(call())
    assert not done and seen == []
    task = loop.create_task(pending.drive())
    first.set_result("a")
    await asyncio.sleep(0)
    second.set_exception(KeyError("k"))
    assert await asyncio.wait_for(task, 5) == "finished"
    assert seen == ["a", "KeyError('k')"]


async def test_cancelling_the_task_cancels_the_call_where_it_waits():
    loop = asyncio.get_running_loop()
    waited = loop.create_future()
    cleaned = asyncio.Event()

    async def call() -> None:
        try:
            await waited
        finally:
            cleaned.set()

    done, pending = eager.start(call())
    assert not done
    task = loop.create_task(pending.drive())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert cleaned.is_set() and waited.cancelled()
