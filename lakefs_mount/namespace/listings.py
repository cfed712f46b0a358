"""S3 listings merged into the tree, at most once per metadata TTL, and how long a lookup
waits for them: a directory's listing comes from S3 merged with what exists only in the
cache (files not yet committed) and what pending namespace changes make or remove.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from lakefs_mount.cache.cachefile import CachedFile, CommittedBase
from lakefs_mount.cache.manager import CacheManager
from lakefs_mount.namespace.dirindex import RESERVED_NAME
from lakefs_mount.namespace.inode import (
    DEFAULT_DIR_MODE,
    DEFAULT_FILE_MODE,
    ROOT_INO,
    Inode,
    Kind,
    valid_name,
)
from lakefs_mount.namespace.invalidations import Invalidations
from lakefs_mount.namespace.namelog import NameLog
from lakefs_mount.namespace.tree import Tree
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.objectstore import ObjectInfo, ObjectStoreError

log = logging.getLogger(__name__)

# How long a lookup in a directory listed before waits for S3 to list it again before the
# last listing answers (the listing goes on, and lands when S3 answers): S3 lists a
# directory in milliseconds when it is well; a stuck connection may take minutes. The wait
# is PATIENCE_FACTOR times the slowest of S3's recent listings, within these bounds.
LIST_PATIENCE = 2.0
PATIENCE_FLOOR = 0.25
PATIENCE_FACTOR = 4.0
RECENT_LISTINGS = 16
SLOW_FOR = 10.0  # after S3 was slow, names the mount knows answer at once for this long


@dataclass(eq=False)
class UnderWay:
    """S3 work running in a task of its own (a listing, attributes): waiters share it,
    and may stop waiting while it goes on and lands later."""

    done: trio.Event = field(default_factory=trio.Event)
    started: float = field(default_factory=trio.current_time)
    error: Exception | None = None
    result: Any = None



MAX_HIDDEN_KEPT = 10_000  # hidden keys remembered (each is logged once)
HIDDEN_EXAMPLES = 5  # ... of them named in status


class Listed(Tree):
    def __init__(self, store: AsyncStore, cache: CacheManager, prefix: str, ttl: float,
                 owner: tuple[int, int], names: NameLog | None,
                 kernel: Invalidations | None,
                 modes: tuple[int, int] = (DEFAULT_FILE_MODE, DEFAULT_DIR_MODE)) -> None:
        super().__init__(prefix, owner, modes)
        self.store = store
        # Namespace changes not yet in S3: a listing shows what they make and hides what
        # they remove, as the bucket will once they are applied.
        self.names = names
        # What the kernel caches of names and files found changed in S3 (the session sends)
        self.kernel = kernel if kernel is not None else Invalidations()
        # The cache learns of files seen in S3 (a previous mount may hold them: adopt_warm),
        # of bases moving to a new version (their cached chunks are void: invalidate), and
        # GETs small objects whole at lookup (fetch_small_object).
        self.cache = cache
        self.ttl = ttl
        self._listings: dict[int, UnderWay] = {}  # directories being listed right now
        self._nursery: trio.Nursery | None = None  # where listings run (run())
        self._slow_until = 0.0  # monotonic time until which S3 counts as slow
        self._slow_at = -math.inf  # monotonic time S3 last counted as slow
        self._list_seconds: deque[float] = deque(maxlen=RECENT_LISTINGS)  # S3's recent ones
        self._probe: UnderWay | None = None  # a HEAD asking whether S3 answers at all
        # Objects a directory of the same name hides (`a` beside `a/...`): POSIX cannot
        # show both. Said once each in the log, and in status (`hidden`).
        self.hidden: dict[str, None] = {}

    # -- S3 listings ----------------------------------------------------------------

    def new_remote_file(self, key: str, obj: ObjectInfo) -> CachedFile:
        uid, gid = self.owner
        cf = CachedFile(key=key, size=obj.size, mode=self.file_mode, uid=uid, gid=gid,
                        mtime_ns=int(obj.mtime * 1e9),
                        base=CommittedBase(obj.key, obj.size, obj.etag,
                                           validated_at=time.monotonic()))
        self.cache.adopt_warm(cf)
        return cf

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Where listings run: in tasks of their own, so that a lookup can stop waiting
        for a slow S3 while the listing goes on and lands later."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._first_listing, self._start_listing(self.inodes[ROOT_INO]))
            task_status.started()
            await trio.sleep_forever()

    async def _first_listing(self, listing: UnderWay) -> None:
        """The root is listed at mount, while S3 answers: a lookup there during an outage
        answers from that listing after a moment instead of waiting for S3 (30 s for a
        directory never listed). It counts as expired at once: a name another node makes
        meanwhile shows at the next lookup, as without it."""
        await listing.done.wait()
        if listing.error is None:
            self.inodes[ROOT_INO].listed_at -= self.ttl

    def start_soon(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Run `fn` in a task that outlives the request which starts it."""
        assert self._nursery is not None, "Namespace.run is not running"
        self._nursery.start_soon(fn, *args)

    def in_background(self, fn: Callable[[], Awaitable[object]]) -> UnderWay:
        """Run `fn` in a task of its own; its result or error goes to whoever waits
        (a failure there must not end the daemon: the request that waits reports it)."""
        work = UnderWay()

        async def run_it() -> None:
            try:
                work.result = await fn()
            except Exception as exc:
                work.error = exc
            finally:
                work.done.set()

        self.start_soon(run_it)
        return work

    async def within_patience(self, work: UnderWay) -> bool:
        """Wait for `work` as long as a lookup waits for S3 (patience); False if it has
        not ended by then, and S3 counts as slow."""
        patience = self.patience(True)
        with trio.move_on_at(work.started + patience if patience else -math.inf):
            await work.done.wait()
        if not work.done.is_set():
            self.kept_waiting(work.started)
        return work.done.is_set()

    def kept_waiting(self, started: float) -> None:
        """Work started at `started` (trio time) outlasted a lookup's patience: S3 counts
        as slow for a while, unless it answered anything else meanwhile. A loaded S3 that
        answers uploads and reads is alive: else one listing past the patience on a busy
        machine would mark it slow, and for SLOW_FOR seconds opens would serve the version
        last seen and lookups the last listing without asking it."""
        if not self._answered_since(started):
            self.s3_was_slow()

    def s3_slow(self) -> bool:
        """S3 failed or kept a listing waiting a moment ago: names and attributes the
        mount knows answer at once instead of waiting for it again."""
        return time.monotonic() < self._slow_until

    def s3_was_slow(self) -> None:
        self._slow_at = time.monotonic()
        self._slow_until = self._slow_at + max(self.ttl, SLOW_FOR)

    def patience(self, listed_before: bool) -> float:
        """Seconds a lookup waits for a listing before the mount's own knowledge answers:
        none while S3 is known to be slow; for a directory listed before, a few times
        what S3 took to list lately (a black hole shows within a fraction of a second);
        for one never listed, as long as its listing takes (bounded by its requests'): a
        healthy S3 may take seconds to list a huge directory, and no name in it is known
        before (the root is listed at mount, so an outage shows in a listed one first)."""
        if self.s3_slow():
            return 0.0
        if not listed_before:
            return math.inf
        return self._recent_patience()

    def _recent_patience(self) -> float:
        if not self._list_seconds:
            return LIST_PATIENCE
        return min(LIST_PATIENCE, max(PATIENCE_FLOOR, PATIENCE_FACTOR * max(self._list_seconds)))

    async def ensure_listed(self, dir_inode: Inode, force: bool = False,
                            lenient: bool = False) -> None:
        """Merge the S3 listing of a directory into its children, at most once per TTL.

        A directory listed before waits a moment for S3 (patience; none while S3 is
        slow): then its last listing answers, and the listing lands when S3 does. One
        never listed waits for S3 and fails if S3 does, unless `lenient` (a lookup by
        name, which a create needs to go on): then what the mount knows of it answers
        once the listing failed, or once S3 shows no sign of life for a lookup's patience
        (answered_while_alive), the listing lands when S3 answers, S3 is asked again
        after the TTL, and the log says so once per directory.

        Lookups that find the directory being listed wait for that listing and take its
        outcome instead of sending their own (else 8 readers opening files of a new directory
        send 8 listings); a forced listing must start after the call, so it waits its turn.
        """
        if not force and dir_inode.listed_at and (
                time.monotonic() - dir_inode.listed_at < self.ttl
                or self._pending(self.key_of(dir_inode))):
            return  # (S3 has not even its marker yet: it holds nothing the mount lacks)
        if lenient and time.monotonic() - dir_inode.unlistable_at < self.ttl:
            return
        running = self._listings.get(dir_inode.ino)
        if running is not None and force:
            await self._await_listing(dir_inode, running, lenient)
            if self._listings.get(dir_inode.ino) is not None:
                return  # S3 is slow: the last listing answers
            running = None
        if running is None:
            running = self._start_listing(dir_inode)
        await self._await_listing(dir_inode, running, lenient)

    def _start_listing(self, dir_inode: Inode) -> UnderWay:
        async def list_it() -> None:
            try:
                await self._list(dir_inode)
            finally:
                del self._listings[dir_inode.ino]

        listing = self._listings[dir_inode.ino] = self.in_background(list_it)
        return listing

    async def _await_listing(self, dir_inode: Inode, listing: UnderWay,
                             lenient: bool) -> None:
        """S3 gets a moment (patience) to list a directory listed before, and as long as
        it shows signs of life to list one never listed. If it has not listed it by then,
        the last listing answers, or what the mount knows of a never-listed one for a
        lookup (`lenient`); anything else (`ls`, rmdir) fails with EIO at once: it would
        need S3's answer, and waiting for its bound (30 s) helps no one."""
        if dir_inode.listed_at:
            answered = await self.within_patience(listing)
        else:
            quiet = self.s3_slow() and not self._answered_after(self._slow_at)
            answered = await self.answered_while_alive(listing, quiet=lenient and quiet)
        if not answered:
            waited = trio.current_time() - listing.started
            if not dir_inode.listed_at and not lenient:
                raise ObjectStoreError(
                    f"S3 has not answered in {waited:.2f} s and {self.key_of(dir_inode)} "
                    "was never listed: it is listed when S3 answers")
            if not dir_inode.unlistable_at:
                log.warning("S3 has not listed %s in %.2f s; %s", self.key_of(dir_inode),
                            waited, "serving the last listing" if dir_inode.listed_at else
                            "names in it are looked up among what this mount knows")
            dir_inode.unlistable_at = time.monotonic()
            return
        if listing.error is None:
            return
        if not lenient:
            raise listing.error
        if not dir_inode.unlistable_at:
            log.warning("listing %s failed (%s): names in it are looked up among what "
                        "this mount knows until S3 answers", self.key_of(dir_inode),
                        listing.error)
        dir_inode.unlistable_at = time.monotonic()

    def _answered_since(self, started: float) -> bool:
        """Did S3 answer any request (an upload, a read) since `started` (trio time)?"""
        return self._answered_after(time.monotonic() - (trio.current_time() - started))

    def _answered_after(self, moment: float) -> bool:
        """Did S3 answer any request after `moment` (monotonic)?"""
        stats = getattr(self.store.sync, "stats", None)
        return stats is not None and bool(stats.last_answer_at > moment)

    async def answered_while_alive(self, work: UnderWay, quiet: bool = False) -> bool:
        """Wait for `work` while S3 shows signs of life: where answering without S3 could
        be wrong (a name hidden in a directory never listed, a symlink served as a file),
        a healthy S3 gets the time it takes (a huge listing, a GET on a slow link). Past
        a lookup's patience a HEAD asks whether S3 answers at all; if that goes
        unanswered for the patience too, S3 counts as slow and False says so.

        `quiet`: S3 counted as slow and has answered nothing since. It gets the patience
        too, and if it answers anything meanwhile (the slow listing that marked it), the
        wait goes on; no HEAD is sent (one sent into an outage is still unanswered for a
        while after S3 is back, and would make it look quiet then). Such a lookup must not
        answer from what the mount knows at once: one listing past a lookup's patience on
        a loaded machine counts S3 as slow, and a lookup in a directory never listed would
        then answer ENOENT for a file S3 has (a checkpoint's `.metadata` missing in a cold
        mount's restore)."""
        patience = self._recent_patience()
        with trio.move_on_at(work.started + patience):
            await work.done.wait()
        if work.done.is_set():
            return True
        if quiet:
            if not self._answered_after(self._slow_at):
                return False
            await work.done.wait()
            return True
        probe = self._probe
        if probe is None or probe.done.is_set():  # (one under way at a time, in a black hole)
            # One attempt: sent into an outage, it ends at its time bound and the next
            # lookup sends a fresh one; retried, it went on long after S3 was back, and
            # meanwhile S3 looked quiet to every lookup.
            probe = self._probe = self.in_background(
                lambda: self.store.head(self.prefix + RESERVED_NAME + "/", attempts=1))
        with trio.move_on_at(max(probe.started, trio.current_time() - patience) + patience):
            await probe.done.wait()
        if (probe.done.is_set() and (probe.error is None  # any answer of S3's is a sign of life
                                     or getattr(probe.error, "status", None) is not None)
                or self._answered_since(work.started)):  # a loaded S3 (the probe queued
            await work.done.wait()                       # behind uploads) is alive too
            return True
        self.s3_was_slow()
        return work.done.is_set()

    async def _list(self, dir_inode: Inode) -> None:
        prefix = self.key_of(dir_inode)
        try:
            # What was local when the listing started stays, even if its commit lands while
            # the listing is under way (the listing may predate the object).
            local_at_start = {name for name, ino in dir_inode.children.items()
                              if self._has_local_state(self.inodes[ino])}
            started = time.monotonic()
            while True:
                listed = self._objects_of(prefix)
                listing = await self.store.list_dir(listed)
                prefix = self.key_of(dir_inode)  # (renamed while S3 listed it: its new place)
                if self._objects_of(prefix) == listed:
                    break
                # a written-back move of the directory landed while S3 listed its old place
                # (its files were rebased, the old keys are going): list where they are now
            self._list_seconds.append(time.monotonic() - started)
        except ObjectStoreError as exc:
            if not dir_inode.listed_at:
                raise
            # S3 is unavailable: the last listing plus the cache keep the mount usable,
            # for another TTL before S3 is asked again; said once until S3 lists it again.
            if not dir_inode.unlistable_at:
                log.warning("listing %s failed (%s); serving the last listing", prefix, exc)
            dir_inode.unlistable_at = dir_inode.listed_at = time.monotonic()
            self.s3_was_slow()
            return
        dir_inode.unlistable_at = 0.0
        self._slow_until = 0.0
        seen: set[str] = set()
        for sub in listing.prefixes:
            name = sub[len(listed):].rstrip("/")
            if not valid_name(name):
                continue
            seen.add(name)
            existing = self.child(dir_inode, name)
            if existing is not None and not existing.is_dir:
                self._hide(sub, prefix + name)  # a file shown before the objects below came
            elif existing is None and not self._removed(prefix + name + "/", started):
                self.add_listed_dir(dir_inode, name)
        for obj in listing.objects:
            name = obj.key[len(listed):]
            if not valid_name(name):
                continue  # the directory's own marker, or a name POSIX cannot show
            seen.add(name)
            existing = self.child(dir_inode, name)
            if existing is not None and existing.is_dir:
                self._hide(obj.key, prefix + name)
                continue
            if existing is None and self._removed(prefix + name, started):
                continue  # unlinked or renamed here; S3 does not know yet
            if existing is None:
                cf = self.new_remote_file(prefix + name, obj)
                inode = self.add(dir_inode, name, Kind.FILE, file=cf)
                inode.headed = False
            elif existing.file is not None:
                self._refresh_file(existing, obj, started)
        for key in self.names.dirs_made_in(prefix) if self.names is not None else ():
            name = key[len(prefix):-1]  # (made before a crash: the journal knows it)
            if valid_name(name) and self.child(dir_inode, name) is None:
                self.add_listed_dir(dir_inode, name)
        for name, ino in list(dir_inode.children.items()):
            if (name not in seen and name not in local_at_start
                    and not self._has_local_state(self.inodes[ino])):
                self.detach(self.inodes[ino])
                self.kernel.entry(dir_inode.ino, name)
        dir_inode.listed_at = time.monotonic()

    def _hide(self, key: str, path_key: str) -> None:
        """`key` (an object, or a prefix ending in "/") is not shown: its name is shown as
        the other kind (a name is a file or a directory, not both)."""
        if key in self.hidden:
            return
        if len(self.hidden) < MAX_HIDDEN_KEPT:
            self.hidden[key] = None
        where = f"s3://{self.store.sync.bucket}/{key}"
        name = path_key[len(self.prefix):]
        if key.endswith("/"):
            log.warning("the objects below %s are not shown: %s is a file here. Move that "
                        "file, or the objects, to another name to see them", where, name)
        else:
            log.warning("%s is not shown: objects below it make %s a directory here. Move "
                        "the object to another key with an S3 tool to see it", where, name)

    def status(self) -> dict[str, object]:
        """`hidden_objects`: how many objects or prefixes a name of the other kind hides;
        `hidden_examples`: the first few of them (None: none)."""
        if not self.hidden:
            return {"hidden_objects": None, "hidden_examples": None}
        return {"hidden_objects": len(self.hidden),
                "hidden_examples": list(self.hidden)[:HIDDEN_EXAMPLES]}

    def _objects_of(self, prefix: str) -> str:
        """Where S3 holds the objects of the directory `prefix`: a directory renamed here
        whose objects S3 has not moved yet is listed where they are, and its files read
        from there until the move's copies land (then they are rebased)."""
        return (self.names.moved_from(prefix) if self.names is not None else None) or prefix

    def _refresh_file(self, inode: Inode, obj: ObjectInfo, listed_at: float) -> None:
        """A listing saw the object: unchanged, that validates it for close-to-open (no
        HEAD at the next open: one LIST stands for a HEAD of every file in it); changed in
        S3 (written elsewhere), what we cached of it is dropped.

        Not a change made elsewhere: an object this mount replaces (a rename over the
        name, not yet moved in S3), or one a listing sent before this mount's own commit
        or move landed still shows (S3 confirmed the file's base after the listing was
        sent). Taken for one, the name served the bytes it had replaced."""
        cf = inode.file
        assert cf is not None
        if cf.base.etag == obj.etag:
            if cf.base.key == obj.key:
                cf.validated(listed_at)
            return
        if (cf.pending or cf.openers or listed_at < cf.base.validated_at
                or self._pending(self.key_of(inode))):
            return
        self.cache.invalidate(cf)
        cf.object_seen(obj.key, obj.size, obj.etag, time.monotonic())
        cf.set_attrs(mtime_ns=int(obj.mtime * 1e9), ctime_ns=0)  # (its metadata: a HEAD)
        cf.atime_ns = None
        cf.base.meta = None
        inode.headed = False
        self.kernel.inode(inode.ino)

    def _pending(self, key: str) -> bool:
        return self.names is not None and self.names.creating(key)

    def _removed(self, key: str, listed_since: float | None = None) -> bool:
        """A change here removes `key`, or (for a listing sent at `listed_since`) removed
        it after that listing was sent."""
        return self.names is not None and self.names.removing(key, listed_since)

    def _has_local_state(self, inode: Inode) -> bool:
        """True if the entry exists only here so far (pending content, a fresh dir, a
        name a pending namespace change makes)."""
        if self._pending(self.key_of(inode)):
            return True
        if inode.file is not None:
            return inode.file.pending or inode.file.openers > 0
        if inode.is_dir and inode.listed_at and time.monotonic() - inode.listed_at < self.ttl:
            return True
        return any(self._has_local_state(d) for d in self.descendants(inode))
