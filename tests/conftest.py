"""Shared fixtures: a real control plane (in-process gRPC server on a loopback port)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/harness helpers

from kvbaton import logs  # noqa: E402

logs.configure("WARNING")


def pytest_collection_modifyitems(config, items):
    # Long end-to-end tests last, so quick failures show first.
    items.sort(key=lambda it: 1 if it.get_closest_marker("vllm") else 0)
