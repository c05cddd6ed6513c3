"""Input limits and their checks, shared by every service.

The limits are part of the API (README "Limits"): a request beyond one is refused with
INVALID_ARGUMENT and a message naming the field, before anything is written.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .errors import invalid

MAX_ID_BYTES = 256
MAX_BLOCK_IDS = 65_536
MAX_BLOCK_ID = 2**31 - 1
MAX_AGENT_METADATA_BYTES = 4 * 1024 * 1024
MAX_REGIONS = 4_096
MAX_LABELS = 32
MAX_LABEL_BYTES = 256
MAX_REASON_BYTES = 1_024
MAX_HASH_BYTES = 64
MAX_TP_SIZE = 1_024
MAX_KEEPALIVE_BATCH = 10_000

MIN_LEASE_TTL_MS = 100
MAX_LEASE_TTL_MS = 24 * 3600 * 1000
DEFAULT_PIN_TTL_MS = 10_000
MAX_PIN_TTL_MS = 60_000
MIN_RENDEZVOUS_TIMEOUT_MS = 1
MAX_RENDEZVOUS_TIMEOUT_MS = 600_000
DEFAULT_RENDEZVOUS_TIMEOUT_MS = 30_000
MIN_ENGINE_TTL_MS = 1_000
MAX_ENGINE_TTL_MS = 600_000
DEFAULT_ENGINE_TTL_MS = 10_000
# A transfer's attempt may grow by at most this much per message (a retry is +1), so no
# message can pre-empt a transfer for good (attempt 2**32-1 could never be superseded).
MAX_ATTEMPT_STEP = 16

# Ids travel inside store keys: printable ASCII without '/' keeps keys unambiguous.
# Matched whole (``fullmatch``): ``$`` would also match before a final newline, letting
# "id\n" into store keys.
_ID_RE = re.compile(r"[\x21-\x2e\x30-\x7e]+")


def check_id(field: str, value: str, *, required: bool = True) -> str:
    if not value:
        if required:
            raise invalid(f"{field} is required")
        return value
    if len(value.encode()) > MAX_ID_BYTES:
        raise invalid(f"{field} is {len(value.encode())} bytes; the limit is {MAX_ID_BYTES}")
    if not _ID_RE.fullmatch(value):
        raise invalid(f"{field} {value[:64]!r} must be printable ASCII without spaces or '/'")
    return value


def check_block_ids(field: str, ids: Sequence[int], *, required: bool = True, unique: bool = True) -> list[int]:
    n = len(ids)
    if n == 0 and required:
        raise invalid(f"{field} is empty")
    if n > MAX_BLOCK_IDS:
        raise invalid(f"{field} has {n} ids; the limit is {MAX_BLOCK_IDS} per message")
    # A protobuf repeated field slices to a list in one C call (about half of list()'s
    # cost per message, whose element-by-element iteration shows at hundreds a second).
    out = ids[:]
    if type(out) is not list:
        out = list(ids)
    if out and max(out) > MAX_BLOCK_ID:
        raise invalid(f"{field} holds id {max(out)} above {MAX_BLOCK_ID}")
    if unique and len(set(out)) != n:
        raise invalid(f"{field} holds duplicate block ids")
    return out


def check_range(field: str, value: int, lo: int, hi: int, *, default: int | None = None) -> int:
    if value == 0 and default is not None:
        return default
    if not lo <= value <= hi:
        raise invalid(f"{field} is {value}; it must lie in [{lo}, {hi}]")
    return value


def check_text(field: str, value: str, limit: int = MAX_REASON_BYTES) -> str:
    if len(value.encode()) > limit:
        raise invalid(f"{field} is {len(value.encode())} bytes; the limit is {limit}")
    return value


def check_labels(field: str, labels: dict[str, str]) -> dict[str, str]:
    if len(labels) > MAX_LABELS:
        raise invalid(f"{field} has {len(labels)} entries; the limit is {MAX_LABELS}")
    for k, v in labels.items():
        if not k or len(k.encode()) > MAX_LABEL_BYTES or len(v.encode()) > MAX_LABEL_BYTES:
            raise invalid(f"{field} entry {k[:32]!r} is empty or longer than {MAX_LABEL_BYTES} bytes")
    return dict(labels)


# Engine ids found valid (a fleet has few, named on every message of a transfer): looked
# up before the checks are run again. Bounded; what it holds passed ``check_engine_id``.
_VALID_ENGINE_IDS: set[str] = set()
_VALID_ENGINE_IDS_MAX = 4096


def check_engine_id(field: str, value: str, *, required: bool = True) -> str:
    """An id an engine may have: a valid id that is not reserved (``*`` and anything with
    ``*``: the route of events meant for every engine)."""
    if value in _VALID_ENGINE_IDS:
        return value
    check_id(field, value, required=required)
    if "*" in value:
        raise invalid(f"{field} {value[:64]!r} is reserved ('*' routes to every engine); pick another engine id")
    if value:
        if len(_VALID_ENGINE_IDS) >= _VALID_ENGINE_IDS_MAX:
            _VALID_ENGINE_IDS.clear()
        _VALID_ENGINE_IDS.add(value)
    return value
