"""Namespace changes written back like data: journaled before the reply, applied in order.

mkdir, rmdir, unlink and rename (of a file, or of a directory and everything below it)
change the mount's tree at once and are recorded in the journal (`name_ops`) before the
kernel gets its answer; this log applies
them to S3 in the background, retrying like data, so a training loop never waits on S3
for them. Changes that touch one key, or a directory and a key below it, go
in the order they were made; independent ones go in parallel. A data commit waits for
the earlier changes that touch its key (`busy`, `wait_clear`): an unlink followed by a
new file of the same name never deletes the new object, and a directory's marker (with
its attributes) is in S3 before the objects below it.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import trio

from lakefs_mount import metrics as m
from lakefs_mount.cache.asyncjournal import AsyncJournal
from lakefs_mount.cache.flusher import ERRORS_BEFORE_FLUSH_FAILS, FlushFailed
from lakefs_mount.cache.journalschema import NameOpRow
from lakefs_mount.concurrency import each_bounded
from lakefs_mount.namespace.dirattrs import DirAttrs, DirStat
from lakefs_mount.namespace.latewrites import LateWrites
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.layout import META_PARTS, encode_attrs
from lakefs_mount.s3.objectstore import NoSuchKey, ObjectInfo, ObjectStoreError

log = logging.getLogger(__name__)

DIR = "dir"  # PUT a directory marker (arg: its attributes)
RMDIR = "rmdir"  # DELETE a directory marker (and its attributes)
DELETE = "delete"  # DELETE an object
MOVE = "move"  # CopyObject key -> dst, then DELETE key
# arg of the MOVE of a file whose upload a rename kept at `key` (it completes there first):
# finding nothing at `key` is expected (the upload left the file uncompleted, or a crash
# came first and its bytes went again to `dst`)
KEPT_UPLOAD = "kept-upload"
# DELETE the table of part CRCs `key` (s3/parttable) that the object at `dst` named, once
# the changes recorded before it that touch `dst` (an unlink's DELETE, a rename's move onto
# it) are in S3; kept if the object at `dst` still names it (a replay after a crash that
# came before the object was replaced, an object copied back). Never holds up a commit.
TABLE = "table"
# (the arg of a DELETE recorded while the file's commit was under way is that file's fid:
# that commit's request may still land after the DELETE, which latewrites watches for)
QUICK_ATTEMPTS = 3  # per S3 call; the op itself is retried for ever, with backoff
CONCURRENCY = 16
# A listing answered before a removal landed may still show what it removed: removals are
# remembered this long after they land (longer than any listing takes).
LANDED_FOR = 600.0
# Test hook: a move stops for good between its copy and its delete (a kill -9 there
# proves the replay); never set outside tests.


def overlap(a: str, b: str) -> bool:
    """Keys one of which orders the other: equal, or a directory and a key below it."""
    return a == b or (a.endswith("/") and b.startswith(a)) or (
        b.endswith("/") and a.startswith(b))


def dir_arg(st: DirStat, replace: bool) -> str:
    return json.dumps({"mode": st.mode, "uid": st.uid, "gid": st.gid,
                       "mtime_ns": st.mtime_ns, "replace": replace})


@dataclass(eq=False)
class NameOp:
    row: NameOpRow
    done: trio.Event = field(default_factory=trio.Event)
    running: bool = False
    # (not journaled) held by a commit that must end first, or set once an unlinked open
    # file's bytes are cached
    after: trio.Lock | trio.Event | None = None
    error_streak: int = 0
    error_count: int = 0
    last_error: str | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.row.key,) if self.row.dst is None else (self.row.key, self.row.dst)

    def describe(self) -> str:
        row = self.row
        if row.op == TABLE:
            return f"{TABLE} {row.key} (of {row.dst})"
        return f"{row.op} {row.key}" + (f" -> {row.dst}" if row.dst is not None else "")


class NameLog:
    """The namespace changes not yet in S3, their order, and the task that applies them."""

    def __init__(self, store: AsyncStore, journal: AsyncJournal, metrics: m.Metrics, *,
                 dir_attrs: DirAttrs | None,
                 on_record: Callable[[str, str, str | None], None] | None = None,
                 late: LateWrites | None = None, hold_after_copy: bool = False) -> None:
        """`hold_after_copy`: a test hook (HooksForTests.hold_move_after_copy)."""
        self.store = store
        self.journal = journal
        self.metrics = metrics
        self.hold_after_copy = hold_after_copy
        self.dir_attrs = dir_attrs
        # A move's copy is in S3: files whose unchanged bytes were at `src` now find them
        # at `dst` (their journal rows change in the same transaction as the step), whose
        # ETag the copy gave (a copy of a multipart object gets a new one: a listing must
        # not take it for a change made elsewhere). Set by the assembly once the namespace
        # exists.
        self.rebase: Callable[[str, str, dict[str, str]], None] = lambda src, dst, etags: None
        self.ops: list[NameOp] = []  # pending, in the order they were made
        self._creating: Counter[str] = Counter()  # keys a pending op makes (dir, move dst)
        self._removing: Counter[str] = Counter()  # keys a pending op removes
        self._moved_into: Counter[str] = Counter()  # directories a pending move fills
        self._landed: OrderedDict[str, float] = OrderedDict()  # key -> when its removal
        # landed in S3 (time.monotonic()), oldest first, for LANDED_FOR seconds
        self._copy_limiter = trio.CapacityLimiter(CONCURRENCY)
        self._wake = trio.Event()
        self._changed = trio.Event()
        self.applied = 0
        # told of every change as it is recorded (op, key, dst): --commit-on-rename
        self.on_record = on_record
        self.late = late  # watches the key of a DELETE that followed a commit under way

    # -- recording --------------------------------------------------------------------

    async def load(self) -> int:
        """The changes a previous mount recorded and did not finish (at mount, before
        anything is served); they are applied again, each step idempotent."""
        for row in await self.journal(self.journal.sync.name_ops):
            self._add(NameOp(row))
        return len(self.ops)

    async def record(self, op: str, key: str, dst: str | None = None, arg: str | None = None,
                     *, drop_fid: int | None = None,
                     rekey: tuple[int, str, str | None] | None = None,
                     rekey_prefix: tuple[str, str] | None = None,
                     after: trio.Lock | trio.Event | None = None,
                     tables: Sequence[tuple[str, str]] = ()) -> None:
        """Journal one change (with the `files` rows change that goes with it); from here
        on it reaches S3 whatever happens to the daemon. `after`: a commit's lock, or an
        event, which the change waits for (after a crash nothing is under way).
        `tables`: (table, key) of tables of part CRCs that the objects this change
        replaces or removes at `key` named; deleted once it is in S3 (TABLE, recorded
        in the same transaction)."""
        rows = [(op, key, dst, arg), *((TABLE, table, at, None) for table, at in tables)]
        add = functools.partial(self.journal.sync.add_name_ops, rows, drop_fid=drop_fid,
                                rekey=rekey, rekey_prefix=rekey_prefix)
        seqs = await self.journal(add)
        for seq, row in zip(seqs, rows, strict=True):
            self._add(NameOp(NameOpRow(seq, *row), after=after if row is rows[0] else None))
        if self.on_record is not None:
            self.on_record(op, key, dst)

    async def retire_tables(self, tables: Sequence[tuple[str, str]]) -> None:
        """Delete these tables of part CRCs (table, key): a change already in S3 (a commit
        over the object at `key`) replaced the object that named each."""
        if tables:
            rows = [(TABLE, table, at, None) for table, at in tables]
            seqs = await self.journal(self.journal.sync.add_name_ops, rows)
            for seq, row in zip(seqs, rows, strict=True):
                self._add(NameOp(NameOpRow(seq, *row)))

    def _add(self, op: NameOp) -> None:
        self.ops.append(op)
        creates, removes = _effects(op.row)
        self._creating.update(creates)
        self._removing.update(removes)
        self._moved_into.update(k for k in creates if op.row.op == MOVE and k.endswith("/"))
        self._wake.set()

    def _drop(self, op: NameOp) -> None:
        self.ops.remove(op)
        creates, removes = _effects(op.row)
        now = time.monotonic()
        for key in removes:
            self._landed.pop(key, None)
            self._landed[key] = now
        while self._landed and next(iter(self._landed.values())) < now - LANDED_FOR:
            self._landed.popitem(last=False)
        self._creating.subtract(creates)
        self._removing.subtract(removes)
        self._moved_into.subtract(k for k in creates if op.row.op == MOVE and k.endswith("/"))
        for counter in (self._creating, self._removing, self._moved_into):
            for key in [*creates, *removes]:
                if counter.get(key, 1) <= 0:
                    del counter[key]
        op.done.set()
        self._wake.set()
        self._changed.set()
        self._changed = trio.Event()

    # -- what listings and commits need to know ---------------------------------------

    def creating(self, key: str) -> bool:
        """A pending change makes `key` (S3 may not show it yet): a marker, a file's
        move, anything below a directory being moved."""
        return key in self._creating or any(
            key.startswith(d) for d in self._moved_into)

    def removing(self, key: str, since: float | None = None) -> bool:
        """A pending change removes `key` (S3 may still show it); with `since` (when a
        listing was sent, time.monotonic()), also one that landed after it: S3 may have
        answered the listing before."""
        if key in self._removing:
            return True
        landed = self._landed.get(key)
        return since is not None and landed is not None and landed >= since

    def removed_lately(self, key: str) -> bool:
        """A removal of `key` (a file, or a directory as "key/") landed in the last
        LANDED_FOR seconds."""
        return key in self._landed or key + "/" in self._landed

    def dirs_made_in(self, prefix: str) -> list[str]:
        """Keys of directories that pending changes make right below `prefix`, and that
        the last pending change of each leaves there (`mkdir s; rmdir s` twice, with the
        second pair pending: no `s`)."""
        return [k for k in self._creating if k.endswith("/") and k.startswith(prefix)
                and k != prefix and "/" not in k[len(prefix):-1] and self._last_makes(k)]

    def _last_makes(self, key: str) -> bool:
        """The latest pending change that makes or removes `key` makes it."""
        for op in reversed(self.ops):
            creates, removes = _effects(op.row)
            if key in creates:
                return True
            if key in removes:
                return False
        return False

    def moved_from(self, dir_key: str) -> str | None:
        """Where S3 still holds the objects of directory `dir_key`: below the source of a
        pending move of a directory above it whose copy has not started landing (None:
        at `dir_key` itself). Moves of moves are followed back, latest first."""
        key = dir_key
        for op in reversed(self.ops):
            row = op.row
            if (row.op == MOVE and row.dst is not None and row.dst.endswith("/")
                    and key.startswith(row.dst) and row.step == 0):
                key = row.key + key[len(row.dst):]
        return None if key == dir_key else key

    def object_key(self, key: str, base_key: str | None) -> str | None:
        """Where a file named `key` has its committed object once the changes before now
        are in S3: at its name if a pending rename moves it there, else at its base."""
        if base_key is not None and self.creating(key):
            return key
        return base_key

    def busy(self, key: str, upto: trio.Event | None = None) -> bool:
        """A pending change touches `key` or a directory above or below it; with `upto`,
        one recorded before the change that waits for that event (a commit it waits for
        comes between them)."""
        for op in self.ops:
            if upto is not None and op.after is upto:
                return False
            if op.row.op != TABLE and any(overlap(key, k) for k in op.keys):
                return True
        return False

    async def wait_clear(self, key: str, upto: trio.Event | None = None) -> None:
        while self.busy(key, upto):
            await self._changed.wait()

    async def drain(self, prefix: str | None = None) -> None:
        """Return once every change made before the call under `prefix` is in S3; fail
        as a flush of data does once one keeps failing (the daemon keeps trying)."""
        targets = {op: op.error_count for op in self.ops
                   if prefix is None or any(k == prefix or k.startswith(prefix.rstrip("/") + "/")
                                            for k in op.keys)}
        self.store.wake_retries()
        while True:
            left = [op for op in targets if not op.done.is_set()]
            if not left:
                return
            failing = [op for op in left if op.error_streak >= ERRORS_BEFORE_FLUSH_FAILS
                       and op.error_count - targets[op] >= ERRORS_BEFORE_FLUSH_FAILS]
            if failing:
                raise FlushFailed(
                    f"{failing[0].describe()} keeps failing: {failing[0].last_error}; "
                    f"{len(left)} namespace change(s) not yet in S3 (the daemon keeps "
                    "retrying)")
            with trio.move_on_after(1.0):
                await self._changed.wait()

    def status(self) -> dict[str, object]:
        errors = [op.last_error for op in self.ops if op.error_streak]
        return {"name_changes_pending": len(self.ops),
                "name_changes_error": errors[0] if errors else None}

    # -- applying ---------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        limiter = trio.CapacityLimiter(CONCURRENCY)
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                for op in self._ready():
                    op.running = True
                    nursery.start_soon(self._apply_task, op, limiter)
                await self._wake.wait()
                self._wake = trio.Event()

    def _ready(self) -> list[NameOp]:
        """Ops with no earlier pending op they must follow."""
        ready: list[NameOp] = []
        earlier: set[str] = set()
        for op in self.ops:
            blocked = any(
                k in earlier or any(a in earlier for a in _ancestors(k))
                or (k.endswith("/") and any(e.startswith(k) for e in earlier))
                for k in op.keys)
            if not blocked and not op.running:
                ready.append(op)
            earlier.update(op.keys if op.row.op != TABLE else (op.row.key,))  # (nothing
            # waits for a table's removal)
        return ready

    async def _apply_task(self, op: NameOp, limiter: trio.CapacityLimiter) -> None:
        if isinstance(op.after, trio.Event):  # an open file's bytes are in the cache
            await op.after.wait()
        elif op.after is not None:
            async with op.after:  # the commit under way at the unlink has ended
                pass
        while True:
            try:
                async with limiter:
                    await self._apply(op)
                break
            except ObjectStoreError as exc:
                op.error_streak += 1
                op.error_count += 1
                op.last_error = str(exc)
                self.metrics[m.RETRIES] += 1
                log.warning("%s not yet in S3: %s (the daemon keeps trying)",
                            op.describe(), exc)
                self._changed.set()
                self._changed = trio.Event()
                await self.store.backoff(min(30.0, 0.5 * 2 ** min(op.error_streak, 6)))
        watch = None
        if self.late is not None and op.row.op == DELETE and op.row.arg is not None:
            watch = (op.row.key, int(op.row.arg), self.late.until())  # (see latewrites)
        await self.journal(self.journal.sync.end_name_op, op.row.seq, watch)
        if watch is not None and self.late is not None:
            self.late.follow(*watch)
        self.applied += 1
        self._drop(op)

    async def _s3(self, what: str, fn: Callable[..., object], *args: object) -> object:
        return await self.store.retrying(what, fn, *args, max_attempts=QUICK_ATTEMPTS)

    async def _each(self, fn: Callable[[str], Awaitable[object]], keys: list[str]) -> None:
        await each_bounded(fn, keys, self._copy_limiter)

    async def _move_dir(self, row: NameOpRow) -> None:
        """Every object below `key` to the same place below `dst`: the directories'
        attributes first (sidecar keys, dirattrs), then the copies, then the deletes.
        Each step may run again after a crash: the source is listed anew each time, and
        nothing writes below `dst` before the move is done (commits there wait for it)."""
        src, dst = row.key, row.dst
        assert dst is not None and row.arg is not None
        attrs = json.loads(row.arg)
        st = DirStat(attrs["mode"], attrs["uid"], attrs["gid"], attrs["mtime_ns"])
        sync = self.store.sync

        def listing() -> list[ObjectInfo]:
            return list(sync.list_recursive(src))

        objects = cast(list[ObjectInfo], await self._s3(f"list {src}", listing))
        old_attrs: list[str] = []
        if self.dir_attrs is not None:  # (again after a crash: the keys it copies are PUTs)
            old_attrs, _ = await self.dir_attrs.copy_tree(src, dst, st)

        etags: dict[str, str] = {}

        async def copy(key: str) -> None:
            moved = dst + key[len(src):]
            if key.endswith("/"):  # a marker: SeaweedFS cannot CopyObject a key ending in
                info = await self._s3(f"HEAD {key}", sync.head, key)  # "/"; nothing to copy
                meta = info.metadata if isinstance(info, ObjectInfo) else {}
                await self._s3(f"PUT {moved}", sync.put, moved, b"", meta)
            else:
                self.metrics[m.SERVER_SIDE_COPIES] += 1
                etags[moved] = str(await self._s3(f"CopyObject {key} -> {moved}", sync.copy,
                                                  key, moved, None))

        async def delete(key: str) -> None:
            self.metrics[m.DELETES] += 1
            await self._s3(f"DELETE {key}", sync.delete, key)

        if row.step == 0:
            await self._each(copy, [o.key for o in objects])
            await self.journal(self.journal.sync.name_op_copied, row.seq, src, dst)
            row.step = 1
            self.rebase(src, dst, etags)
        keys = [o.key for o in objects]
        await self._each(delete, [k for k in keys if not k.endswith("/")] + old_attrs)
        for folders in _folders(src, keys):
            await self._each(delete, folders)
        if src not in keys:  # no marker to move: the new name gets one
            meta = encode_attrs(st.mode, st.uid, st.gid, st.mtime_ns)
            await self._s3(f"PUT {dst}", sync.put, dst, b"", meta)

    async def _apply(self, op: NameOp) -> None:
        row = op.row
        sync = self.store.sync
        started = time.monotonic()
        if row.op == DIR:
            assert row.arg is not None
            attrs = json.loads(row.arg)
            st = DirStat(attrs["mode"], attrs["uid"], attrs["gid"], attrs["mtime_ns"])
            if self.dir_attrs is not None:  # the sidecar first: see FileSystem._save_dir_attrs
                await self.dir_attrs.save(row.key, st, replace=attrs["replace"])
            meta = encode_attrs(st.mode, st.uid, st.gid, st.mtime_ns)
            await self._s3(f"PUT {row.key}", sync.put, row.key, b"", meta)
        elif row.op == RMDIR:
            await self._s3(f"DELETE {row.key}", sync.delete, row.key)
            if self.dir_attrs is not None:
                await self.dir_attrs.remove(row.key)
        elif row.op == DELETE:
            self.metrics[m.DELETES] += 1
            await self._s3(f"DELETE {row.key}", sync.delete, row.key)
        elif row.op == TABLE:
            await self._delete_table(row)
        elif row.op == MOVE and row.key.endswith("/"):
            await self._move_dir(row)
        elif row.op == MOVE:
            assert row.dst is not None
            if row.step == 0:
                try:
                    self.metrics[m.SERVER_SIDE_COPIES] += 1
                    etag = await self._s3(f"CopyObject {row.key} -> {row.dst}", sync.copy,
                                          row.key, row.dst, None)
                except NoSuchKey:  # deleted behind the mount's back: nothing to move
                    if row.arg == KEPT_UPLOAD:
                        log.debug("%s: nothing to move", op.describe())
                    else:
                        log.error("rename %s -> %s: the object is gone from S3", row.key,
                                  row.dst)
                    return
                await self.journal(self.journal.sync.name_op_copied, row.seq, row.key,
                                   row.dst)
                row.step = 1
                self.rebase(row.key, row.dst, {row.dst: str(etag)})
                if self.hold_after_copy:
                    await trio.sleep_forever()
            await self._s3(f"DELETE {row.key}", sync.delete, row.key)
        else:
            log.error("unknown namespace change %r in the journal: skipped", row.op)
        log.debug("%s applied in %.3f s", op.describe(), time.monotonic() - started)


    async def _delete_table(self, row: NameOpRow) -> None:
        assert row.dst is not None
        info = await self._s3(f"HEAD {row.dst}", self.store.sync.head, row.dst)
        if isinstance(info, ObjectInfo) and info.metadata.get(META_PARTS) == row.key:
            log.info("the table of part CRCs %s is kept: %s still names it", row.key, row.dst)
            return
        self.metrics[m.DELETES] += 1
        await self._s3(f"DELETE {row.key}", self.store.sync.delete, row.key)


def _folders(prefix: str, keys: list[str]) -> list[list[str]]:
    """The folder keys of a tree (its marker, and each directory its keys lie in),
    deepest first: stores such as SeaweedFS keep a folder for every key even where no
    marker was written, and list one that still holds anything as a directory."""
    folders = {prefix}
    for key in keys:
        parts = key[len(prefix):].split("/")[:-1]
        folders.update(prefix + "/".join(parts[:i]) + "/" for i in range(1, len(parts) + 1))
    depths = sorted({f.count("/") for f in folders}, reverse=True)
    return [sorted(f for f in folders if f.count("/") == depth) for depth in depths]


def _effects(row: NameOpRow) -> tuple[list[str], list[str]]:
    """The keys a change makes and the keys it removes (new attributes of a directory
    that S3 has already make nothing)."""
    if row.op == DIR:
        return ([] if row.arg and json.loads(row.arg).get("replace") else [row.key]), []
    if row.op == MOVE:
        assert row.dst is not None
        return [row.dst], [row.key]
    return [], [row.key]


def _ancestors(key: str) -> list[str]:
    """The directory keys above `key` ("a/b/c" -> "a/", "a/b/")."""
    parts = key.rstrip("/").split("/")[:-1]
    return ["/".join(parts[:i]) + "/" for i in range(1, len(parts) + 1)]
