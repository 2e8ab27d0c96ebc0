"""Settling a transfer's future from whichever thread gets there first."""

from __future__ import annotations

from concurrent.futures import Future, InvalidStateError
from typing import TypeVar

T = TypeVar("T")


def settle(future: Future[T], result: T) -> bool:
    """Complete `future` unless it is already settled; True if this call settled it."""
    try:
        future.set_result(result)
    except InvalidStateError:
        return False
    return True


def settle_error(future: Future[T], error: BaseException) -> bool:
    """Fail `future` unless it is already settled; True if this call settled it."""
    try:
        future.set_exception(error)
    except InvalidStateError:
        return False
    return True
