"""Attribute indexes of directories: what an S3 listing cannot tell, so `ls -l` costs no HEAD
per file on a fresh mount.

A listing gives each object's size and ETag, not its user metadata (mode, owner, mtime,
symlink), and readdirplus must hand the kernel all of it. So for each directory a mount
commits files in, it keeps one small JSON object under the reserved folder
`PREFIX/.lakefs-mount/attrs/<directory>/<writer>.json`: for each name, the ETag, size and
user metadata of the object. A reader lists that folder and GETs its few objects instead
of one HEAD per file. An entry counts only while the listing shows the same ETag and
size, so an index that is stale, lost or written by another mount only costs HEADs,
never wrong attributes of changed content. Each writer (mount cache) has its own object,
so mounts on several nodes never overwrite each other's entries.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from lakefs_mount import metrics as m
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.checksums import ChecksumUse
from lakefs_mount.s3.layout import RESERVED_NAME
from lakefs_mount.s3.objectstore import ObjectStoreError, key_fits

log = logging.getLogger(__name__)

INDEX_FOLDER = RESERVED_NAME + "/attrs/"
FORMAT = 1
WRITE_DELAY = 1.0  # commits arriving within this time go into one rewrite of the index
MAX_ENTRIES = 100_000  # a bigger directory has no index (~150 bytes an entry)
LOAD_CONCURRENCY = 8
RETRY_DELAYS = (10.0, 300.0)  # after a failed round, doubling (S3 may refuse for good)
WRITER_SHARE = 10  # the writer sleeps at least this many times as long as its last round


@dataclass(frozen=True)
class IndexEntry:
    etag: str
    size: int
    meta: dict[str, str]  # the object's user metadata, lower-case names


Snapshot = Callable[[str], Awaitable[dict[str, IndexEntry] | None]]


def index_folder(prefix: str, dir_key: str) -> str:
    """Where the indexes of the directory whose key (prefix + path + "/") is `dir_key` live."""
    return prefix + INDEX_FOLDER + dir_key[len(prefix):]


def parent_dir_key(prefix: str, key: str) -> str:
    """Key of the directory holding the object `key` (the prefix itself for the root)."""
    head, sep, _ = key[len(prefix):].rpartition("/")
    return prefix + head + sep


def encode(entries: dict[str, IndexEntry]) -> bytes:
    return json.dumps({"format": FORMAT, "entries": {
        name: [e.etag, e.size, e.meta] for name, e in sorted(entries.items())}},
        separators=(",", ":")).encode()


def decode(body: bytes) -> dict[str, IndexEntry]:
    """Entries of an index object; anything malformed (another format, garbage) is skipped."""
    try:
        doc = json.loads(body)
        if doc.get("format") != FORMAT:
            return {}
        items = doc["entries"].items()
    except (ValueError, AttributeError, KeyError, TypeError):
        return {}
    out: dict[str, IndexEntry] = {}
    for name, value in items:
        try:
            etag, size, meta = value
        except (TypeError, ValueError):
            continue
        if (isinstance(etag, str) and isinstance(size, int) and isinstance(meta, dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
            out[name] = IndexEntry(etag, size, meta)
    return out


class DirIndex:
    """Reads every writer's index of a directory; writes this mount's, after its commits."""

    def __init__(self, store: AsyncStore, prefix: str, writer: str, snapshot: Snapshot,
                 *, write_delay: float = WRITE_DELAY) -> None:
        self.store = store
        self.prefix = prefix
        self.writer = writer
        self.snapshot = snapshot  # dir key -> entries to write; None: the directory is gone
        self.write_delay = write_delay
        self.checksums = ChecksumUse.from_environment()  # (S3 refuses a damaged index)
        self._changed: set[str] = set()
        self._wake = trio.Event()
        self._written: dict[str, int] = {}  # dir key -> hash of the body last written
        self._write_lock = trio.Lock()

    def own_key(self, dir_key: str) -> str:
        return index_folder(self.prefix, dir_key) + self.writer + ".json"

    # -- reading -----------------------------------------------------------------------

    async def load(self, dir_key: str) -> dict[str, list[IndexEntry]]:
        """Every writer's entries for the directory, by name; {} if S3 cannot say."""
        folder = index_folder(self.prefix, dir_key)
        found: dict[str, list[IndexEntry]] = {}
        try:
            listing = await self.store.list_dir(folder)
        except (ObjectStoreError, OSError) as exc:
            log.info("attribute index of %s not read (%s): HEADs instead", dir_key, exc)
            return found
        limiter = trio.CapacityLimiter(LOAD_CONCURRENCY)

        def read(key: str) -> dict[str, IndexEntry]:  # parsed in the worker thread too
            got = self.store.sync.get(key)
            return {} if got is None else decode(got[1])

        async def one(key: str) -> None:
            async with limiter:
                self.store.metrics[m.INDEX_READS] += 1
                try:
                    entries = await self.store.call(read, key)
                except (ObjectStoreError, OSError) as exc:
                    log.info("attribute index %s not read: %s", key, exc)
                    return
            for name, entry in entries.items():
                found.setdefault(name, []).append(entry)

        async with trio.open_nursery() as nursery:
            for obj in listing.objects:  # directly in the folder (a delimiter listing)
                if obj.key.endswith(".json"):
                    nursery.start_soon(one, obj.key)
        return found

    # -- writing -----------------------------------------------------------------------

    def changed(self, dir_key: str) -> None:
        """Something this mount committed, renamed or removed in the directory."""
        self._changed.add(dir_key)
        self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        task_status.started()
        took, retry = 0.0, RETRY_DELAYS[0]
        while True:
            await self._wake.wait()
            # Let a burst of commits land first; and rewriting big indexes while files keep
            # coming takes at most a tenth of the time (flush and unmount do not wait).
            await trio.sleep(max(self.write_delay, WRITER_SHARE * took))
            self._wake = trio.Event()
            started = trio.current_time()
            ok = await self.write_changed()
            took = trio.current_time() - started
            if ok:
                retry = RETRY_DELAYS[0]
            else:
                await trio.sleep(retry)
                retry = min(2 * retry, RETRY_DELAYS[1])
                self._wake.set()

    async def write_changed(self, timeout: float = math.inf) -> bool:
        """Write the indexes of the changed directories; False if some write failed (they
        stay marked changed). Errors never reach the caller: an index only saves HEADs."""
        async with self._write_lock:
            todo, self._changed = self._changed, set()
            done: set[str] = set()
            with trio.move_on_after(timeout):
                for dir_key in sorted(todo):
                    try:
                        await self._write(dir_key)
                        done.add(dir_key)
                    except (ObjectStoreError, OSError) as exc:
                        log.warning("attribute index of %s not written: %s (written again "
                                    "later)", dir_key, exc)
                        self.store.metrics[m.RETRIES] += 1  # (as the namespace log counts)
            self._changed |= todo - done
            return done == todo

    async def _write(self, dir_key: str) -> None:
        if not key_fits(self.own_key(dir_key)):
            return  # a directory this deep gets no index (nor can it have one): HEADs
        entries = await self.snapshot(dir_key)
        if entries is None:  # the directory is gone (removed, renamed): every writer's index
            self._written.pop(dir_key, None)
            folder = index_folder(self.prefix, dir_key)
            for obj in (await self.store.list_dir(folder)).objects:
                await self.store.delete(obj.key)
            return
        if len(entries) > MAX_ENTRIES:
            log.info("%s holds %d files: no attribute index", dir_key, len(entries))
            entries = {}
        if not entries:
            self._written.pop(dir_key, None)
            await self.store.delete(self.own_key(dir_key))
            return
        key, last = self.own_key(dir_key), self._written.get(dir_key)

        def put() -> tuple[int, bool]:  # encoding up to MAX_ENTRIES entries: not in the loop
            body = encode(entries)
            digest = hash(body)
            if digest == last:
                return digest, False
            self.store.sync.put(key, body, {}, self.checksums.crc_of(body))
            return digest, True

        self._written[dir_key], wrote = await self.store.call(put)
        if wrote:
            self.store.metrics[m.INDEX_WRITES] += 1
