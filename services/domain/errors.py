"""Domain errors: what went wrong, in terms any transport can map (gRPC, HTTP)."""

from __future__ import annotations

import enum


class Code(enum.Enum):
    """A subset of the canonical status codes (the names match gRPC's)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    ABORTED = "ABORTED"
    UNAVAILABLE = "UNAVAILABLE"


class DomainError(Exception):
    """A refused request: the state is unchanged and the message says why."""

    def __init__(self, code: Code, message: str, *, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        # A refusal that passes (overload, rate, a full queue): how long the client should
        # wait before trying again. 0: no hint (a limit that waiting does not lift soon).
        self.retry_after_ms = retry_after_ms

    def __repr__(self) -> str:
        return f"DomainError({self.code.value}, {self.message!r})"


def invalid(message: str) -> DomainError:
    return DomainError(Code.INVALID_ARGUMENT, message)


def not_found(message: str) -> DomainError:
    return DomainError(Code.NOT_FOUND, message)


def precondition(message: str) -> DomainError:
    return DomainError(Code.FAILED_PRECONDITION, message)


def exhausted(message: str, *, retry_after_ms: int = 0) -> DomainError:
    return DomainError(Code.RESOURCE_EXHAUSTED, message, retry_after_ms=retry_after_ms)


def denied(message: str) -> DomainError:
    """The caller is authenticated but the record belongs to someone else."""
    return DomainError(Code.PERMISSION_DENIED, message)
