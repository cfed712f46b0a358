"""The journal from the trio loop: `AsyncJournal` runs the synchronous `Journal`'s calls
in a worker thread, one at a time, in order, batching those that queue up."""

from __future__ import annotations

import functools
import logging
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, TypeVarTuple

import trio

from lakefs_mount.cache.journal import Journal
from lakefs_mount.cache.journalschema import CleanNote

T = TypeVar("T")
Args = TypeVarTuple("Args")
log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Call:
    fn: Callable[[], Any]
    shared: bool = False  # a `durable`: one run serves every such call of its batch
    taken: bool = False  # by a batch, which runs it whatever happens to its caller
    value: Any = None
    error: Exception | None = None
    finished: trio.Event = field(default_factory=trio.Event)

    def run(self) -> None:
        try:
            self.value = self.fn()
        except Exception as exc:  # handed to the caller on the trio side
            self.error = exc


class AsyncJournal:
    """The journal from the trio loop: calls run one at a time, in order, in a thread.

    Calls that queue up while one runs go to the thread together, in one hop, each still
    in its own transaction; with one journal thread, a hop per call would make concurrent
    writers of small files wait for each other's hops (an intent at create, another at
    the first write). Notes of fetched clean chunks (`note_clean_later`) wait in memory
    and go in with the next call or `write_notes`, in one transaction: a hop per fetched
    small file would make cold small-file reads queue the same way. The order of journal
    changes stays the order of the calls. A crash can
    lose only such notes, and a chunk the journal does not know is fetched again.
    """

    def __init__(self, journal: Journal) -> None:
        self.sync = journal
        self._lock = trio.Lock()  # fair: batches run in the order their calls came
        self._queue: list[_Call] = []
        self._notes: list[CleanNote] = []

    async def __call__(self, fn: Callable[[*Args], T], *args: *Args) -> T:
        return await self._call(_Call(functools.partial(fn, *args)))  # type: ignore[no-any-return]

    async def durable(self) -> None:
        """`Journal.sync`: every change made so far survives a machine crash. The syncs
        that queue up behind a running batch share one WAL fsync at the end of theirs:
        sixteen files fsynced at once (DCP's writer threads) cost one, not sixteen in a
        row, each waiting for the disk."""
        await self._call(_Call(self.sync.sync, shared=True))

    async def _call(self, call: _Call) -> Any:
        self._queue.append(call)
        try:
            async with self._lock:
                if not call.taken:
                    await self._run_queued()
        except trio.Cancelled:
            if not call.taken:
                self._queue.remove(call)
                raise
            with trio.CancelScope(shield=True):  # it runs anyway: report how it went
                await call.finished.wait()
        if call.error is not None:
            raise call.error
        return call.value

    async def _run_queued(self) -> None:
        batch, self._queue = self._queue, []
        notes, self._notes = self._notes, []
        for call in batch:
            call.taken = True

        def run() -> None:
            try:
                self.sync.note_clean_many(notes)
            except sqlite3.Error as exc:  # only warmth is lost: those chunks are refetched
                log.warning("journal: notes of %d cached chunk(s) not written: %s",
                            len(notes), exc)
            shared = [call for call in batch if call.shared]
            for call in batch:
                if not call.shared:
                    call.run()
            if shared:  # after every other call: it covers them too
                shared[0].run()
                for call in shared[1:]:
                    call.error = shared[0].error

        try:
            await trio.to_thread.run_sync(run, abandon_on_cancel=False)
        finally:
            for call in batch:
                call.finished.set()

    def note_clean_later(self, fid: int, key: str, etag: str, size: int,
                         indices: list[int]) -> None:
        self._notes.append((fid, key, etag, size, indices))

    async def write_notes(self) -> None:
        if self._notes:
            await self(lambda: None)
