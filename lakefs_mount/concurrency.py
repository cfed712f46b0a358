"""Bounded parallel work in the trio loop, failing as one call does."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import trio

T = TypeVar("T")


async def each_bounded(fn: Callable[[T], Awaitable[object]], items: Iterable[T],
                       limiter: trio.CapacityLimiter) -> None:
    """`fn` on every item, in parallel behind `limiter`; the first failure is raised
    itself (not as a group), and the rest are cancelled."""
    async def one(item: T) -> None:
        async with limiter:
            await fn(item)

    try:
        async with trio.open_nursery() as nursery:
            for item in items:
                nursery.start_soon(one, item)
    except ExceptionGroup as group:
        raise group.exceptions[0] from group


def first_cause(exc: BaseException) -> BaseException:
    """The first exception inside nested exception groups (trio's nurseries wrap them)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
