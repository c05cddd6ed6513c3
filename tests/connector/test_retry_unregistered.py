"""A push Complete refused because the engine's registration lapsed is sent again (connector/control.py).

Fake calls and an injected clock/sleep: what is retried (NOT_FOUND "is not registered"), what
is not (any other error), and that the budget bounds it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from kvbaton.connector.control import retry_while_unregistered, unregistered


def _err(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details,
                                debug_error_string=None)


LAPSED = _err(grpc.StatusCode.NOT_FOUND, "engine p0 is not registered")


class Clock:
    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


def _calls(*outcomes: Any) -> tuple[Any, list[int]]:
    seen: list[int] = []

    async def fn(_client: object) -> Any:
        seen.append(1)
        out = outcomes[min(len(seen), len(outcomes)) - 1]
        if isinstance(out, BaseException):
            raise out
        return out
    return fn, seen


def test_a_lapsed_engine_is_called_again_until_registered() -> None:
    clock = Clock()
    fn, seen = _calls(LAPSED, LAPSED, "ok")
    call = retry_while_unregistered(fn, 15.0, sleep=clock.sleep, clock=clock.now)
    assert asyncio.run(call(object())) == "ok"  # type: ignore[arg-type]
    assert len(seen) == 3 and clock.sleeps == [0.5, 1.0]


@pytest.mark.parametrize("exc", [_err(grpc.StatusCode.NOT_FOUND, "transfer t1 not found"),
                                 _err(grpc.StatusCode.INVALID_ARGUMENT, "engine p0 is not registered"),
                                 RuntimeError("boom")])
def test_other_errors_are_final(exc: BaseException) -> None:
    clock = Clock()
    fn, seen = _calls(exc, "ok")
    with pytest.raises(type(exc)):
        asyncio.run(retry_while_unregistered(fn, 15.0, sleep=clock.sleep, clock=clock.now)(object()))  # type: ignore[arg-type]
    assert len(seen) == 1 and not clock.sleeps


def test_the_budget_bounds_the_retries() -> None:
    clock = Clock()
    fn, seen = _calls(LAPSED)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(retry_while_unregistered(fn, 5.0, sleep=clock.sleep, clock=clock.now)(object()))  # type: ignore[arg-type]
    assert unregistered(info.value)
    assert clock.sleeps == [0.5, 1.0, 2.0] and len(seen) == 4  # 0.5+1+2 = 3.5 s; a 2 s more would pass 5 s
