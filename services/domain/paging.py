"""Paging for every List: a page is bounded by a count and by its size in bytes, and the
next one is asked for with an opaque token (the sort key of the last item returned).

Why both bounds: a count alone cannot keep an answer under gRPC's message limit when
items are large (an engine record carries up to 4 MiB of NIXL agent metadata), and a
byte bound alone would let a page hold a million tiny records. A page always holds at
least one item, so paging never stalls.

Tokens are cursors, not snapshots: an item whose sort key changes between pages (a lease
renewed while an operator pages by deadline) may be seen twice or not at all; items that
do not change are seen exactly once.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Sequence
from typing import TypeVar

from .errors import invalid

T = TypeVar("T")

DEFAULT_PAGE_SIZE = 500
MAX_PAGE_SIZE = 1_000
# Well under the 16 MiB message limit, leaving room for one big item past the bound.
MAX_PAGE_BYTES = 4 * 1024 * 1024

SortKey = tuple


def page_size(requested: int, limit: int = 0) -> int:
    """The page size to use: the request's (or the old ``limit`` field), capped by the server."""
    want = requested or limit or DEFAULT_PAGE_SIZE
    return max(1, min(want, MAX_PAGE_SIZE))


def encode_token(kind: str, key: SortKey) -> str:
    return base64.urlsafe_b64encode(json.dumps([kind, list(key)], separators=(",", ":")).encode()).decode()


def decode_token(kind: str, token: str) -> SortKey | None:
    """The sort key a token resumes after (None for an empty token); a token that is not
    one of ours for this list is refused."""
    if not token:
        return None
    try:
        got_kind, key = json.loads(base64.urlsafe_b64decode(token.encode()))
        if got_kind != kind or not isinstance(key, list):
            raise ValueError(kind)
        return tuple(key)
    except (ValueError, TypeError) as exc:
        raise invalid(f"page_token is not a token of this list ({kind}): {type(exc).__name__}") from None


def paginate(
    items: Sequence[T],
    *,
    key: Callable[[T], SortKey],
    size: Callable[[T], int],
    kind: str,
    page_size: int,
    page_token: str,
    max_bytes: int = MAX_PAGE_BYTES,
) -> tuple[list[T], str]:
    """One page of ``items`` (already sorted by ``key``) after ``page_token``, and the
    token of the next page ("" when this is the last)."""
    after = decode_token(kind, page_token)
    out: list[T] = []
    used = 0
    for item in items:
        k = key(item)
        if after is not None and list(k) <= list(after):
            continue
        n = size(item)
        if out and (len(out) >= page_size or used + n > max_bytes):
            return out, encode_token(kind, key(out[-1]))
        out.append(item)
        used += n
    return out, ""
