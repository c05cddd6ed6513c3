"""The demos' command wrapper: what a user sees when a demo fails or is interrupted."""

from __future__ import annotations

import pytest

from kvbaton.stack.base import run_demo


def test_body_exit_code_is_returned() -> None:
    assert run_demo(lambda: 0) == 0
    assert run_demo(lambda: 3) == 3


def test_failure_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    def body() -> int:
        raise TimeoutError("prefill p0 not healthy after 90 s")

    assert run_demo(body) == 1
    err = capsys.readouterr().err
    assert err.strip() == "FAILED: TimeoutError: prefill p0 not healthy after 90 s"


def test_interrupt_exits_130(capsys: pytest.CaptureFixture[str]) -> None:
    def body() -> int:
        raise KeyboardInterrupt

    assert run_demo(body) == 130
    assert "interrupted" in capsys.readouterr().out
