"""Inodes and their names: the tree the kernel sees, merged from S3 listings and the cache.

Inode numbers are handed out once and stay with a file for the life of the mount, also
across renames. A directory's listing comes from S3 (cached for the metadata TTL) merged
with what exists only in the cache (files not yet committed).
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import os
import stat
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from lakefs_mount.cache.cachefile import CachedFile
from lakefs_mount.cache.manager import CacheManager
from lakefs_mount.concurrency import each_bounded
from lakefs_mount.dirattrs import DirAttrs
from lakefs_mount.dirindex import RESERVED_NAME, DirIndex, IndexEntry
from lakefs_mount.invalidations import Invalidations
from lakefs_mount.namelog import NameLog
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.layout import SPECIAL_TYPES, decode_attrs
from lakefs_mount.s3.objectstore import ObjectInfo, ObjectStoreError

log = logging.getLogger(__name__)

ROOT_INO = 1
DEFAULT_FILE_MODE = stat.S_IFREG | 0o644
DEFAULT_DIR_MODE = stat.S_IFDIR | 0o755
HEAD_CONCURRENCY = 32
# Looked up by name, an object up to this size is fetched whole instead of HEADed: the GET
# brings the same metadata, and the read that usually follows a lookup needs no request.
SMALL_OBJECT_MAX = 256 * 1024


# How long a lookup in a directory listed before waits for S3 to list it again before the
# last listing answers (the listing goes on, and lands when S3 answers): S3 lists a
# directory in milliseconds when it is well; a stuck connection may take minutes. The wait
# is PATIENCE_FACTOR times the slowest of S3's recent listings, within these bounds.
LIST_PATIENCE = 2.0
PATIENCE_FLOOR = 0.25
PATIENCE_FACTOR = 4.0
RECENT_LISTINGS = 16
# A directory never listed: a lookup in it waits this long for S3 before what the mount
# knows answers (a create goes on as a new file); none while S3 is known to be slow.
UNLISTED_PATIENCE = 5.0
SLOW_FOR = 10.0  # after S3 was slow, names the mount knows answer at once for this long


@dataclass(eq=False)
class _Listing:
    """A listing of one directory under way (waiters share it)."""

    done: trio.Event = field(default_factory=trio.Event)
    started: float = field(default_factory=trio.current_time)
    error: ObjectStoreError | None = None


class Kind(enum.Enum):
    FILE = "file"
    DIR = "dir"
    SYMLINK = "symlink"
    SPECIAL = "special"  # FIFO, device or UNIX socket: a zero-byte object the kernel serves


def kind_of(cf: CachedFile) -> Kind:
    """What a file's content and mode make it."""
    if cf.symlink is not None or stat.S_ISLNK(cf.mode):
        return Kind.SYMLINK
    return Kind.SPECIAL if stat.S_IFMT(cf.mode) in SPECIAL_TYPES else Kind.FILE


@dataclass(eq=False)
class Inode:
    ino: int
    kind: Kind
    parent: int
    name: str
    file: CachedFile | None = None  # content and attributes of files and symlinks
    dir_mode: int = DEFAULT_DIR_MODE
    dir_uid: int = 0
    dir_gid: int = 0
    dir_mtime_ns: int = 0
    children: dict[str, int] = field(default_factory=dict)
    subdirs: int = 0  # directories among the children: st_nlink is 2 + subdirs
    listed_at: float = 0.0  # monotonic time of the last S3 listing; 0 = never listed
    unlistable_at: float = 0.0  # when S3 last failed to list it (0: it answered since)
    headed: bool = True  # False: attributes are listing defaults until a HEAD
    indexed_at: float = 0.0  # listed_at when the attribute indexes were last applied
    lookups: int = 0
    ctime_ns: int = 0

    @property
    def is_dir(self) -> bool:
        return self.kind is Kind.DIR

    @property
    def mode(self) -> int:
        return self.file.mode if self.file is not None else self.dir_mode

    @property
    def uid(self) -> int:
        return self.file.uid if self.file is not None else self.dir_uid

    @property
    def gid(self) -> int:
        return self.file.gid if self.file is not None else self.dir_gid

    @property
    def mtime_ns(self) -> int:
        return self.file.mtime_ns if self.file is not None else self.dir_mtime_ns

    @property
    def size(self) -> int:
        if self.file is None:
            return 0
        if self.file.symlink is not None:
            return len(self.file.symlink.encode())
        return self.file.size

    def set_attrs(self, mode: int | None = None, uid: int | None = None,
                  gid: int | None = None, mtime_ns: int | None = None) -> None:
        target: object = self.file if self.file is not None else None
        prefix = "" if target is not None else "dir_"
        obj = target if target is not None else self
        for name, value in (("mode", mode), ("uid", uid), ("gid", gid), ("mtime_ns", mtime_ns)):
            if value is not None:
                setattr(obj, prefix + name, value)
        self.ctime_ns = time.time_ns()


class Namespace:
    def __init__(self, store: AsyncStore, cache: CacheManager, prefix: str, ttl: float,
                 owner: tuple[int, int], *, index_writer: str,
                 dir_attrs: DirAttrs | None, names: NameLog | None = None,
                 kernel: Invalidations | None = None) -> None:
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
        self.prefix = prefix
        self.ttl = ttl
        self.owner = owner
        self._next_ino = itertools.count(ROOT_INO + 1)
        # Directories' attribute indexes, written by this cache as `index_writer`.
        self.index = DirIndex(store, prefix, index_writer, self.index_entries)
        # Where directories' own attributes are kept (None: listed directories show defaults).
        self.dir_attrs = dir_attrs
        now = time.time_ns()
        root = Inode(ROOT_INO, Kind.DIR, ROOT_INO, "", dir_uid=owner[0], dir_gid=owner[1],
                     dir_mtime_ns=now, ctime_ns=now)
        self.inodes: dict[int, Inode] = {ROOT_INO: root}
        self._listings: dict[int, _Listing] = {}  # directories being listed right now
        self._attr_loads: dict[int, _Listing] = {}  # subdirectories' attributes, by parent
        self._nursery: trio.Nursery | None = None  # where listings run (run())
        self._slow_until = 0.0  # monotonic time until which S3 counts as slow
        self._list_seconds: deque[float] = deque(maxlen=RECENT_LISTINGS)  # S3's recent ones

    # -- paths and keys ---------------------------------------------------------------

    def path_of(self, inode: Inode) -> str:
        """Path relative to the mount root, without a leading slash ("" for the root)."""
        parts: list[str] = []
        while inode.ino != ROOT_INO:
            parts.append(inode.name)
            inode = self.inodes[inode.parent]
        return "/".join(reversed(parts))

    def dir_by_key(self, dir_key: str) -> Inode | None:
        """The directory whose key is `dir_key`, if this mount knows it."""
        inode = self.inodes[ROOT_INO]
        for name in dir_key[len(self.prefix):].split("/")[:-1] if dir_key != self.prefix else []:
            child = self.child(inode, name)
            if child is None or not child.is_dir:
                return None
            inode = child
        return inode

    def key_of(self, inode: Inode) -> str:
        path = self.path_of(inode)
        if inode.is_dir:
            return self.prefix + path + "/" if path else self.prefix
        return self.prefix + path

    def get(self, ino: int) -> Inode:
        return self.inodes[ino]

    def child(self, parent: Inode, name: str) -> Inode | None:
        ino = parent.children.get(name)
        return None if ino is None else self.inodes.get(ino)

    # -- creating and moving entries ------------------------------------------------

    def add(self, parent: Inode, name: str, kind: Kind, file: CachedFile | None = None,
            **dir_attrs: int) -> Inode:
        ino = next(self._next_ino)
        inode = Inode(ino, kind, parent.ino, name, file=file, ctime_ns=time.time_ns(),
                      **dir_attrs)  # type: ignore[arg-type]
        if kind is Kind.DIR:
            inode.listed_at = 0.0
        self.inodes[ino] = inode
        self._set_child(parent, name, inode)
        return inode

    def add_listed_dir(self, parent: Inode, name: str) -> Inode:
        """A directory that S3 (or the journal) has: its attributes are loaded before the
        kernel sees it (ensure_headed); till then the mount's owner and defaults."""
        uid, gid = self.owner
        inode = self.add(parent, name, Kind.DIR, dir_uid=uid, dir_gid=gid,
                         dir_mtime_ns=time.time_ns())
        inode.headed = False
        return inode

    def detach(self, inode: Inode) -> None:
        """Remove a name; the inode lives on while the kernel still references it."""
        parent = self.inodes.get(inode.parent)
        if parent is not None:
            self._drop_child(parent, inode)
        if inode.lookups <= 0 and inode.ino != ROOT_INO:
            self.inodes.pop(inode.ino, None)

    def move(self, inode: Inode, new_parent: Inode, new_name: str) -> None:
        self._drop_child(self.inodes[inode.parent], inode)
        inode.parent, inode.name = new_parent.ino, new_name
        self._set_child(new_parent, new_name, inode)
        inode.ctime_ns = time.time_ns()

    def _set_child(self, parent: Inode, name: str, inode: Inode) -> None:
        replaced = self.child(parent, name)
        if replaced is not None and replaced.is_dir:
            parent.subdirs -= 1
        parent.children[name] = inode.ino
        if inode.is_dir:
            parent.subdirs += 1

    def _drop_child(self, parent: Inode, inode: Inode) -> None:
        if parent.children.get(inode.name) == inode.ino:
            del parent.children[inode.name]
            if inode.is_dir:
                parent.subdirs -= 1

    def forget(self, ino: int, count: int) -> None:
        inode = self.inodes.get(ino)
        if inode is None or ino == ROOT_INO:
            return
        inode.lookups -= count
        parent = self.inodes.get(inode.parent)
        attached = parent is not None and parent.children.get(inode.name) == ino
        if inode.lookups <= 0 and not attached:
            del self.inodes[ino]

    def descendants(self, inode: Inode) -> list[Inode]:
        out: list[Inode] = []
        stack = [inode]
        while stack:
            node = stack.pop()
            for ino in node.children.values():
                child = self.inodes.get(ino)
                if child is not None:
                    out.append(child)
                    if child.is_dir:
                        stack.append(child)
        return out

    # -- S3 listings ----------------------------------------------------------------

    def new_remote_file(self, key: str, obj: ObjectInfo) -> CachedFile:
        uid, gid = self.owner
        cf = CachedFile(key=key, size=obj.size, mode=DEFAULT_FILE_MODE, uid=uid, gid=gid,
                        mtime_ns=int(obj.mtime * 1e9), base_key=obj.key, base_size=obj.size,
                        base_etag=obj.etag, validated_at=time.monotonic())
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

    async def _first_listing(self, listing: _Listing) -> None:
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

    def s3_slow(self) -> bool:
        """S3 failed or kept a listing waiting a moment ago: names and attributes the
        mount knows answer at once instead of waiting for it again."""
        return time.monotonic() < self._slow_until

    def s3_was_slow(self) -> None:
        self._slow_until = time.monotonic() + max(self.ttl, SLOW_FOR)

    def patience(self, listed_before: bool) -> float:
        """Seconds a lookup waits for a listing before the mount's own knowledge answers:
        none while S3 is known to be slow; for a directory listed before, a few times
        what S3 took to list lately (a black hole shows within a fraction of a second),
        for one never listed, UNLISTED_PATIENCE (not the listing's 3 attempts of 10 s)."""
        if self.s3_slow():
            return 0.0
        if not listed_before:
            return UNLISTED_PATIENCE
        if not self._list_seconds:
            return LIST_PATIENCE
        return min(LIST_PATIENCE, max(PATIENCE_FLOOR, PATIENCE_FACTOR * max(self._list_seconds)))

    async def ensure_listed(self, dir_inode: Inode, force: bool = False,
                            lenient: bool = False) -> None:
        """Merge the S3 listing of a directory into its children, at most once per TTL.

        A directory listed before waits a moment for S3 (patience; none while S3 is
        slow): then its last listing answers, and the listing lands when S3 does. One
        never listed waits for S3 and fails if S3 does, unless `lenient` (a lookup by
        name, which a create needs to go on): then it waits UNLISTED_PATIENCE at most,
        and what the mount knows of it answers, the listing lands when S3 answers (or
        S3 is asked again after the TTL), and the log says so once per directory.

        Lookups that find the directory being listed wait for that listing and take its
        outcome instead of sending their own (8 readers opening files of a new directory
        sent 8 listings); a forced listing must start after the call, so it waits its turn.
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

    def _start_listing(self, dir_inode: Inode) -> _Listing:
        listing = _Listing()
        self._listings[dir_inode.ino] = listing

        async def list_it() -> None:
            try:
                await self._list(dir_inode)
            except ObjectStoreError as exc:  # (a directory listed before serves its last)
                listing.error = exc
            finally:
                del self._listings[dir_inode.ino]
                listing.done.set()

        assert self._nursery is not None, "Namespace.run is not running"
        self._nursery.start_soon(list_it)
        return listing

    async def _await_listing(self, dir_inode: Inode, listing: _Listing,
                             lenient: bool) -> None:
        if dir_inode.listed_at or lenient:  # S3 gets a moment, not more
            patience = self.patience(bool(dir_inode.listed_at))
            with trio.move_on_at(listing.started + patience if patience else -math.inf):
                await listing.done.wait()
            if not listing.done.is_set():
                self.s3_was_slow()
                if not dir_inode.unlistable_at:
                    log.warning("S3 has not listed %s in %.2f s; %s", self.key_of(dir_inode),
                                trio.current_time() - listing.started,
                                "serving the last listing" if dir_inode.listed_at else
                                "names in it are looked up among what this mount knows")
                dir_inode.unlistable_at = time.monotonic()
                return
        else:
            await listing.done.wait()
        if listing.error is None:
            return
        if not lenient:
            raise listing.error
        if not dir_inode.unlistable_at:
            log.warning("listing %s failed (%s): names in it are looked up among what "
                        "this mount knows until S3 answers", self.key_of(dir_inode),
                        listing.error)
        dir_inode.unlistable_at = time.monotonic()

    async def _list(self, dir_inode: Inode) -> None:
        prefix = self.key_of(dir_inode)
        # (a directory renamed here whose objects S3 has not moved yet is listed where
        # they are; its files read from there until the move's copies land: rebase)
        listed = (self.names.moved_from(prefix) if self.names is not None else None) or prefix
        try:
            # What was local when the listing started stays, even if its commit lands while
            # the listing is under way (the listing may predate the object).
            local_at_start = {name for name, ino in dir_inode.children.items()
                              if self._has_local_state(self.inodes[ino])}
            started = time.monotonic()
            listing = await self.store.list_dir(listed)
            self._list_seconds.append(time.monotonic() - started)
            prefix = self.key_of(dir_inode)  # (renamed while S3 listed it: its new place)
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
            if self.child(dir_inode, name) is None and not self._removed(prefix + name + "/"):
                self.add_listed_dir(dir_inode, name)
        for obj in listing.objects:
            name = obj.key[len(listed):]
            if not valid_name(name):
                continue  # the directory's own marker, or a name POSIX cannot show
            seen.add(name)
            existing = self.child(dir_inode, name)
            if existing is None and self._removed(prefix + name):
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

    def _refresh_file(self, inode: Inode, obj: ObjectInfo, listed_at: float) -> None:
        """A listing saw the object: unchanged, that validates it for close-to-open (no
        HEAD at the next open: one LIST stands for a HEAD of every file in it); changed in
        S3 (written elsewhere), what we cached of it is dropped."""
        cf = inode.file
        assert cf is not None
        if cf.base_etag == obj.etag:
            if cf.base_key == obj.key:
                cf.validated_at = max(cf.validated_at, listed_at)
            return
        if cf.pending or cf.openers:
            return
        self.cache.invalidate(cf)
        cf.size = cf.base_size = obj.size
        cf.base_etag = obj.etag
        cf.base_key = obj.key
        cf.validated_at = time.monotonic()
        cf.mtime_ns = int(obj.mtime * 1e9)
        cf.s3_meta = None
        inode.headed = False
        self.kernel.inode(inode.ino)

    def _pending(self, key: str) -> bool:
        return self.names is not None and self.names.creating(key)

    def _removed(self, key: str) -> bool:
        return self.names is not None and self.names.removing(key)

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

    async def ensure_headed(self, inode: Inode, with_body: bool = False) -> None:
        """Attributes from the object's metadata (mode, owner, mtime, symlink); with_body
        (a lookup by name), a small object comes whole, its bytes go to the cache."""
        cf = inode.file
        if inode.headed:
            return
        if cf is None:
            parent = self.inodes.get(inode.parent)
            if parent is None:
                inode.headed = True
            elif self.dir_attrs is not None and self.dir_attrs.lists_siblings:
                await self._head_dirs(parent, self._unheaded_dirs(parent))
            else:
                await self._head_dirs(parent, [inode])
            return
        if (with_body and not cf.pending
                and not cf.chunks  # a warm cache already holds it: HEAD is enough
                and cf.base_key == cf.key and 0 < cf.size <= SMALL_OBJECT_MAX):
            info = await self.cache.fetch_small_object(cf)
        else:
            info = await self.store.head(cf.key)
        inode.headed = True
        if info is not None:
            self.apply_metadata(inode, info)

    async def ensure_children_headed(self, dir_inode: Inode) -> None:
        """Attributes of the listed files before readdir hands them out: from the
        directory's attribute indexes (dirindex), else a HEAD each.

        readdirplus gives the kernel each entry's type and attributes; a listing knows
        neither a symlink from a file nor the stored mode, and the kernel refuses an inode
        whose type changes later (EIO). The HEADs run concurrently, bounded.
        """
        dirs = self._unheaded_dirs(dir_inode)
        if dirs:
            await self._head_dirs(dir_inode, dirs)
        todo = await self._apply_index(dir_inode)
        if not todo:
            return
        await each_bounded(self.ensure_headed, todo, trio.CapacityLimiter(HEAD_CONCURRENCY))

    async def _head_dirs(self, parent: Inode, dirs: list[Inode]) -> None:
        """Stored attributes of subdirectories (see dirattrs). S3 gets the same moment as
        for a listing (patience): one that S3 cannot tell about by then is served 0700
        and the mount's owner, never looser than it was given, and its attributes land
        when S3 answers (or are asked again at its next lookup)."""
        if self.dir_attrs is None:
            for inode in dirs:
                inode.headed = True
            return
        load = self._attr_loads.get(parent.ino)
        if load is None:
            load = self._start_attr_load(parent, dirs)
        patience = self.patience(True)
        with trio.move_on_at(load.started + patience if patience else -math.inf):
            await load.done.wait()
        if load.done.is_set() and load.error is None and all(d.headed for d in dirs):
            return  # (a load started for other siblings may leave some: asked again later)
        if not load.done.is_set():
            self.s3_was_slow()
        log.warning("attributes of directories in %s not read (%s): served 0700 until "
                    "they are", self.key_of(parent),
                    load.error or f"no answer in {trio.current_time() - load.started:.2f} s")
        for inode in dirs:
            if not inode.headed:
                inode.dir_mode = stat.S_IFDIR | 0o700
                inode.dir_uid, inode.dir_gid = self.owner

    def _start_attr_load(self, parent: Inode, dirs: list[Inode]) -> _Listing:
        """Load the attributes of `dirs` in a task of its own (a lookup stops waiting for a
        quiet S3; they land when it answers)."""
        load = _Listing()
        self._attr_loads[parent.ino] = load
        dir_attrs = self.dir_attrs
        assert dir_attrs is not None

        async def load_them() -> None:
            try:
                found = await dir_attrs.load(self.key_of(parent), [d.name for d in dirs])
            except ObjectStoreError as exc:
                load.error = exc
                return
            finally:
                del self._attr_loads[parent.ino]
                load.done.set()
            for inode in dirs:
                attrs = found.get(inode.name)
                if attrs is None:  # never given any: the defaults (also after a failed read)
                    inode.dir_mode, (inode.dir_uid, inode.dir_gid) = DEFAULT_DIR_MODE, self.owner
                else:
                    inode.dir_mode, inode.dir_uid, inode.dir_gid = (attrs.mode, attrs.uid,
                                                                    attrs.gid)
                    inode.dir_mtime_ns = attrs.mtime_ns
                inode.headed = True

        assert self._nursery is not None, "Namespace.run is not running"
        self._nursery.start_soon(load_them)
        return load

    def _unheaded_dirs(self, parent: Inode) -> list[Inode]:
        children = (self.inodes.get(ino) for ino in parent.children.values())
        return [c for c in children if c is not None and c.is_dir and not c.headed]

    async def _apply_index(self, dir_inode: Inode) -> list[Inode]:
        """Attributes of listed files from the directory's indexes, where an entry matches
        the listed ETag and size (and writers agree); returns the files still unheaded."""
        todo = [self.inodes[ino] for ino in dir_inode.children.values()
                if ino in self.inodes and not self.inodes[ino].headed
                and self.inodes[ino].file is not None]
        if not todo or dir_inode.indexed_at == dir_inode.listed_at:
            return todo  # (the indexes were read since the last listing)
        dir_inode.indexed_at = dir_inode.listed_at
        found = await self.index.load(self.key_of(dir_inode))
        left = []
        for inode in todo:
            cf = inode.file
            assert cf is not None
            if inode.headed:  # a HEAD or a lookup got there while the index loaded
                continue
            metas = [e.meta for e in found.get(inode.name, ())
                     if e.etag == cf.base_etag and e.size == cf.base_size]
            if not metas or any(meta != metas[0] for meta in metas) or cf.base_key != cf.key:
                left.append(inode)
                continue
            inode.headed = True
            self.apply_metadata(inode, ObjectInfo(cf.key, cf.base_size, cf.base_etag or "",
                                                  cf.mtime_ns / 1e9, metas[0]))
        return left

    async def index_entries(self, dir_key: str) -> dict[str, IndexEntry] | None:
        """What this mount knows of the objects in a directory, for its index (None: the
        directory is gone). Files listed but not yet known take what the indexes say first,
        so a rewrite after a remount keeps the entries of the mount before."""
        dir_inode = self.dir_by_key(dir_key)
        if dir_inode is None:
            return None
        await self._apply_index(dir_inode)
        out: dict[str, IndexEntry] = {}
        for name, ino in dir_inode.children.items():
            inode = self.inodes.get(ino)
            cf = inode.file if inode is not None else None
            if (cf is not None and inode is not None and inode.headed and cf.s3_meta is not None
                    and cf.base_etag and cf.base_key == cf.key and not cf.unlinked):
                out[name] = IndexEntry(cf.base_etag, cf.base_size, cf.s3_meta)
        return out

    def index_changed(self, dir_key: str) -> None:
        """This mount changed what the directory holds in S3: its index is due a rewrite."""
        self.index.changed(dir_key)

    def apply_metadata(self, inode: Inode, info: ObjectInfo) -> None:
        cf = inode.file
        assert cf is not None
        if cf.pending:
            return  # local changes not yet committed win over what S3 still holds
        cf.s3_meta = dict(info.metadata)
        attrs = decode_attrs(info.metadata)
        if attrs.mode is not None:
            cf.mode = attrs.mode
        if attrs.uid is not None:
            cf.uid = attrs.uid
        if attrs.gid is not None:
            cf.gid = attrs.gid
        cf.rdev = attrs.rdev
        cf.mtime_ns = attrs.mtime_ns if attrs.mtime_ns is not None else int(info.mtime * 1e9)
        if cf.base_etag != info.etag:
            self.cache.invalidate(cf)
            self.kernel.inode(inode.ino)
        cf.size = cf.base_size = info.size
        cf.base_etag = info.etag
        cf.validated_at = time.monotonic()
        if attrs.is_symlink:
            cf.mode = stat.S_IFLNK | 0o777
        inode.kind = kind_of(cf)

    def rebase(self, src: str, dst: str, etags: dict[str, str]) -> None:
        """An object moved in S3 (a written-back rename; every object below `src` for a
        directory's "prefix/"): files that read their unchanged bytes from `src` find them
        at `dst`, with the ETag the copy gave them (`etags`, by new key), so that the next
        listing does not take the copy for a change made elsewhere."""
        for inode in self.inodes.values():
            cf = inode.file
            if cf is None or cf.base_key is None:
                continue
            if cf.base_key == src:
                cf.base_key = dst
            elif src.endswith("/") and cf.base_key.startswith(src):
                cf.base_key = dst + cf.base_key[len(src):]
            else:
                continue
            if cf.base_key in etags:
                cf.base_etag = etags[cf.base_key]

    def attach_path(self, path: str, file: CachedFile) -> Inode:
        """Place a recovered file at its path, creating directories only known locally."""
        *dirs, name = path.split("/")
        parent = self.inodes[ROOT_INO]
        for part in dirs:
            child = self.child(parent, part)
            if child is None or not child.is_dir:
                child = self.add_listed_dir(parent, part)
            parent = child
        existing = self.child(parent, name)
        if existing is not None:
            self.detach(existing)
        return self.add(parent, name, kind_of(file), file=file)


def valid_name(name: str) -> bool:
    """A name POSIX can show, and not lakefs-mount's own folder (attribute indexes: under
    the mount root, and under the root of any mount of a deeper prefix)."""
    return bool(name) and name != RESERVED_NAME and "/" not in name \
        and name not in (".", "..") and "\0" not in name and len(os.fsencode(name)) <= 255
