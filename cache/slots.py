"""Upload slots that let a waiting flush overtake the background.

The flusher streams every full chunk as soon as it is written, so the slots are mostly
taken by work nobody waits for yet: the parts of a large checkpoint still uploading, or
of a prefix S3 is slow on. A `flush PATH` or `commit PATH` must not queue behind all of
that: holders marked urgent (their file is the target of a flush) take the
next free slot before anyone who came earlier, and when every ordinary slot is busy
they may take one of a few express slots that nobody else uses, as long as that many
ordinary slots are held by the background. So a flush of everything (unmount) keeps to
`capacity` uploads, and memory stays bounded: at most `capacity + express` at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

BACKGROUND, URGENT, EXPRESS = "background", "urgent", "express"  # what a slot holds


@dataclass(eq=False)
class _Waiter:
    owner: Hashable
    granted: trio.Event = field(default_factory=trio.Event)
    lane: str | None = None


class Slots:
    """`capacity` slots in arrival order, urgent holders first, plus `express` slots for
    urgent holders only while the background holds ordinary ones. Urgency is the
    caller's: `hold(owner, urgent)` at arrival, and `prioritize(is_urgent)` for owners
    that became urgent while they wait."""

    def __init__(self, capacity: int, express: int) -> None:
        self.capacity, self.express = capacity, express
        self._used = {BACKGROUND: 0, URGENT: 0, EXPRESS: 0}
        self._waiting: deque[_Waiter] = deque()
        self._urgent: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting) + len(self._urgent)

    @asynccontextmanager
    async def hold(self, owner: Hashable, urgent: bool = False) -> AsyncIterator[None]:
        lane = await self._acquire(owner, urgent)
        try:
            yield
        finally:
            self._release(lane)

    def prioritize(self, is_urgent: Callable[[Hashable], bool]) -> None:
        """Move the waiters whose owner is now urgent ahead, and into free express slots."""
        moved = [w for w in self._waiting if is_urgent(w.owner)]
        if moved:
            self._waiting = deque(w for w in self._waiting if not is_urgent(w.owner))
            self._urgent.extend(moved)
            self._dispatch()

    def _free_lane(self, urgent: bool) -> str | None:
        used = self._used
        if used[BACKGROUND] + used[URGENT] < self.capacity:
            return URGENT if urgent else BACKGROUND
        if urgent and used[EXPRESS] < min(self.express, used[BACKGROUND]):
            return EXPRESS
        return None

    async def _acquire(self, owner: Hashable, urgent: bool) -> str:
        await trio.lowlevel.checkpoint_if_cancelled()
        # (Nobody waits while a slot they may take is free: a freed one goes to a waiter.)
        lane = self._free_lane(urgent)
        if lane is not None:
            self._used[lane] += 1
            await trio.lowlevel.cancel_shielded_checkpoint()
            return lane
        waiter = _Waiter(owner)
        (self._urgent if urgent else self._waiting).append(waiter)
        try:
            await waiter.granted.wait()
        except BaseException:
            if waiter.lane is not None:  # granted as it was cancelled: pass it on
                self._release(waiter.lane)
            else:
                (self._urgent if waiter in self._urgent else self._waiting).remove(waiter)
            raise
        assert waiter.lane is not None
        return waiter.lane

    def _release(self, lane: str) -> None:
        self._used[lane] -= 1
        self._dispatch()

    def _dispatch(self) -> None:
        while self._urgent or self._waiting:
            lane = self._free_lane(bool(self._urgent))
            if lane is None:
                return
            queue = self._urgent if self._urgent else self._waiting
            waiter = queue.popleft()
            self._used[lane] += 1
            waiter.lane = lane
            waiter.granted.set()
