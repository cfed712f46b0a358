"""`commit`: publish a checkpoint directory with its manifest as the very last object.

Flush the subtree (this node's writes), then build the manifest from S3's listing of
it, not from this node's view: on N nodes each mount wrote its own ranks' files, and
`--expect-files` / `--expect` wait until the other nodes' objects are listed. Each
object's CRC-32C comes from this node's cache file where that holds every byte of the
listed version (what this node wrote), else from the object read back from S3. The
manifest goes up last; its presence means "complete" (manifest.py).
"""

from __future__ import annotations

import getpass
import json
import logging
import math
import os
import socket
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from lakefs_mount.cache.asyncjournal import AsyncJournal
from lakefs_mount.cache.cachefile import CachedFile
from lakefs_mount.cache.journal import Journal
from lakefs_mount.config import MountConfig, mount_id
from lakefs_mount.fs.assembly import MountCore
from lakefs_mount.namespace.invalidations import Invalidations
from lakefs_mount.ops.dirprogress import CommitUnderWay, DirProgress
from lakefs_mount.publish.manifest import MANIFEST_NAME, Entry, build, encode_crc
from lakefs_mount.publish.objecthash import ObjectHasher
from lakefs_mount.publish.verify import listed_under, verify_checkpoint
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.layout import decode_attrs, encode_attrs
from lakefs_mount.s3.objectstore import ObjectInfo

log = logging.getLogger(__name__)

Progress = Callable[[dict], Awaitable[None]]
POLL_FIRST = 0.2  # seconds between listings while waiting for other nodes' objects
POLL_MAX = 2.0
HEADS_AT_ONCE = 16
PENDING_META = "pending_commits"  # journal meta: path -> the commit request under way
RESUMED_TIMEOUT = 600.0  # seconds a resumed commit without a --timeout waits for files
MANIFEST_PUT_ATTEMPTS = 6


class CommittingMount(Protocol):
    """What a commit asks of the mount it runs in (the daemon)."""

    config: MountConfig
    store: AsyncStore
    journal: AsyncJournal
    core: MountCore
    invalidations: Invalidations  # (the kernel is told of the manifest at once)
    dirs: DirProgress  # (status shows each commit's stage)
    index_writer: str  # this cache's id, named in the manifest

    async def flush(self, path: str | None, progress: Callable[[dict], Awaitable[None]],
                    *, must_exist: bool = True) -> dict[str, Any]: ...


class CommitFailed(ValueError):
    """The commit did not write its manifest; `str()` says why, for the user."""


@dataclass(frozen=True)
class Expectation:
    files: int | None  # at least this many objects
    names: tuple[str, ...]  # these relative keys

    def missing(self, listed: dict[str, ObjectInfo]) -> str | None:
        """What is not there yet, in words; None once all of it is."""
        absent = [n for n in self.names if n not in listed]
        short = self.files is not None and len(listed) < self.files
        if not absent and not short:
            return None
        words = []
        if short:
            words.append(f"{len(listed)} of {self.files} expected files there")
        if absent:
            shown = ", ".join(absent[:5]) + (", ..." if len(absent) > 5 else "")
            words.append(f"missing {shown}")
        return "; ".join(words)


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


class Publisher:
    """The commit of one directory of the daemon's mount."""

    def __init__(self, daemon: CommittingMount) -> None:
        self.daemon = daemon
        self.store = daemon.store
        self.cache = daemon.core.cache

    async def commit(self, path: str, expect: Expectation, timeout: float | None,
                     progress: Progress) -> dict[str, Any]:
        path = path.strip("/")
        with self.daemon.dirs.commit(path) as under_way:  # (status shows its stage)
            return await self._commit(path, expect, timeout, progress, under_way)

    async def _commit(self, path: str, expect: Expectation, timeout: float | None,
                      progress: Progress, under_way: CommitUnderWay) -> dict[str, Any]:
        prefix = self.daemon.config.prefix + (path + "/" if path else "")
        started = time.monotonic()
        waiting: list[str | None] = [None]
        with trio.move_on_after(math.inf if timeout is None else timeout) as scope:
            await self.daemon.flush(path or None, progress, must_exist=False)  # (says its own)
            under_way.stage = "waiting for the expected files"
            listed = await self._wait_for(prefix, expect, progress, waiting)
            under_way.stage = "computing checksums"
            entries, sources = await self._entries(prefix, listed, progress)
        stage = under_way.stage
        if scope.cancelled_caught:
            why = f" ({waiting[0]})" if waiting[0] and stage.startswith("waiting") else ""
            raise CommitFailed(f"timed out after {timeout:g} s while {stage}{why}; no "
                               f"manifest was written")
        under_way.stage = "writing the manifest"
        body = build(entries, bucket=self.store.sync.bucket, prefix=prefix,
                     committed_at=time.time(), committed_by=self._committer())
        key = prefix + MANIFEST_NAME
        now_ns = time.time_ns()
        meta = encode_attrs(stat.S_IFREG | 0o644, os.getuid(), os.getgid(), now_ns)
        crc = self.daemon.core.flusher.checksums.crc_of(body)  # (S3 refuses it damaged: sent again)
        etag = await self.store.retrying(f"PUT {key}", self.store.sync.put, key, body, meta,
                                         crc, max_attempts=MANIFEST_PUT_ATTEMPTS)
        self._show_manifest(prefix)
        seconds = round(time.monotonic() - started, 3)
        log.info("committed /%s: %d files, %d bytes, manifest %s in %.1f s", path,
                 len(entries), sum(e.size for e in entries), key, seconds)
        return {"manifest": key, "etag": etag, "files": len(entries),
                "bytes": sum(e.size for e in entries), "checksums": sources,
                "seconds": seconds}

    def _show_manifest(self, prefix: str) -> None:
        """This mount shows the manifest it wrote at once, not after --metadata-ttl (as
        other mounts do): its listing of the directory counts as expired, and the kernel
        forgets the name if it had cached it as absent."""
        ns = self.daemon.core.ns
        directory = ns.dir_by_key(prefix)
        if directory is None:
            return
        directory.listed_at = min(directory.listed_at, time.monotonic() - ns.ttl)
        self.daemon.invalidations.entry(directory.ino, MANIFEST_NAME)

    def _committer(self) -> dict[str, Any]:
        config = self.daemon.config
        return {"host": socket.gethostname(), "user": _user(), "uid": os.getuid(),
                "pid": os.getpid(), "mountpoint": str(config.mountpoint),
                "mount_id": mount_id(config.mountpoint), "cache_id": self.daemon.index_writer}

    async def _wait_for(self, prefix: str, expect: Expectation, progress: Progress,
                        waiting: list[str | None]) -> dict[str, ObjectInfo]:
        """The objects of the checkpoint, once the expected ones are listed."""
        delay = POLL_FIRST
        while True:
            listed = listed_under(await self.store.list_recursive(prefix), prefix)
            waiting[0] = expect.missing(listed)
            if waiting[0] is None and not listed and not expect.files:
                raise CommitFailed(f"nothing under {prefix or '/'} in S3: no checkpoint to "
                                   f"commit (a wrong PATH? other nodes not done? then use "
                                   f"--expect-files)")
            if waiting[0] is None:
                return listed
            await progress({"stage": "waiting", "files_present": len(listed),
                            "files_expected": expect.files, "waiting_for": waiting[0]})
            await trio.sleep(delay)
            delay = min(delay * 2, POLL_MAX)

    async def _entries(self, prefix: str, listed: dict[str, ObjectInfo],
                       progress: Progress) -> tuple[list[Entry], dict[str, int]]:
        """One entry per object: its mtime from a HEAD (the mount's metadata), its
        CRC-32C from the cache where it holds that version, else from S3."""
        hasher = ObjectHasher(self.store)
        heads = trio.Semaphore(HEADS_AT_ONCE)
        cached = self._cached_files(prefix)
        entries: list[Entry] = []
        sources = {"cache": 0, "read": 0}

        async def one(rel: str, info: ObjectInfo) -> None:
            async with heads:
                head = await self.store.head(info.key)
            if head is None:  # deleted since the listing: not part of it
                return
            mtime_ns = decode_attrs(head.metadata).mtime_ns
            crc = await self._cached_crc(cached.get(info.key), head)
            source = "cache"
            if crc is None:
                crc, source = await hasher.crc(head.key, head.size, head.etag), "read"
            sources[source] += 1
            entries.append(Entry(rel, head.size, head.etag,
                                 head.mtime if mtime_ns is None else mtime_ns / 1e9,
                                 encode_crc(crc), source))

        await progress({"stage": "checksums", "files": len(listed)})
        async with trio.open_nursery() as nursery:
            for rel, info in listed.items():
                nursery.start_soon(one, rel, info)
        return entries, sources

    def _cached_files(self, prefix: str) -> dict[str, CachedFile]:
        return {cf.key: cf for cf in list(self.cache.files.values())
                if cf.key.startswith(prefix) and not cf.pending and not cf.unlinked}

    async def _cached_crc(self, cf: CachedFile | None, head: ObjectInfo) -> int | None:
        """The CRC-32C of `head`'s version: noted when this cache committed it (from the
        bytes the cache file sent, which S3 checked; in memory, else in the journal),
        else from the cache file if it holds all of it."""
        if cf is not None and not cf.pending and cf.size == head.size:
            if cf.base.crc is not None and cf.base.crc[0] == head.etag:
                return cf.base.crc[1]
            if cf.fid is not None:  # (a commit of an earlier mount of this cache)
                journal = self.cache.journal
                noted = await journal(journal.sync.cached_crc, cf.fid, head.etag)
                if noted is not None:
                    return int(noted)
        if (cf is None or cf.pending or cf.base.etag != head.etag or cf.size != head.size
                or not self.cache.holds(cf, 0, cf.size)):
            return None
        version = cf.version
        crc = await self.cache.cached_crc(cf, 0, cf.size) if cf.size else 0
        if cf.version != version or cf.base.etag != head.etag or cf.pending:
            return None  # written meanwhile: read S3's bytes instead
        return crc


def _expectation(request: dict) -> tuple[str, Expectation, float | None]:
    """PATH, what to wait for and the time bound of a `commit` control request."""
    path, files, names, timeout = (request.get(k) for k in
                                   ("path", "expect_files", "expect", "timeout"))
    if not isinstance(path, str):
        raise CommitFailed("commit: path must be a string")
    if files is not None and (not isinstance(files, int) or files < 0):
        raise CommitFailed("commit: expect_files must be a whole number >= 0")
    names = names or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CommitFailed("commit: expect must be a list of names")
    if timeout is not None and (not isinstance(timeout, int | float) or timeout < 0):
        raise CommitFailed("commit: timeout must be a number of seconds >= 0")
    return path, Expectation(files, tuple(n.strip("/") for n in names)), timeout


def _set_pending(journal: Journal, path: str, request: dict | None) -> None:
    """Record (or, None, forget) the commit of `path` under way (in the journal's thread)."""
    pending = json.loads(journal.get_meta(PENDING_META) or "{}")
    if request is None:
        pending.pop(path, None)
    else:
        pending[path] = request
    journal.set_meta(PENDING_META, json.dumps(pending, sort_keys=True))


async def commit_request(daemon: CommittingMount, request: dict,
                         progress: Progress) -> dict[str, Any]:
    """A commit, recorded in the journal while it runs: a crash before its manifest is
    in S3 leaves the record, and the next mount finishes it (`resume_pending_commits`).
    One that ends (done, failed, interrupted) forgets it: its caller heard how it went."""
    path, expect, timeout = _expectation(request)
    path = path.strip("/")
    record = {"expect_files": expect.files, "expect": list(expect.names), "timeout": timeout,
              "requested_at": time.time()}
    await daemon.journal(_set_pending, daemon.journal.sync, path, record)
    try:
        return await Publisher(daemon).commit(path, expect, timeout, progress)
    finally:
        with trio.CancelScope(shield=True):
            await daemon.journal(_set_pending, daemon.journal.sync, path, None)


async def resume_pending_commits(daemon: CommittingMount) -> None:
    """Finish the commits a crashed mount left (journal), each as it was asked for; one
    without a --timeout waits at most RESUMED_TIMEOUT for the files it expects."""
    found = await daemon.journal(daemon.journal.sync.get_meta, PENDING_META)
    pending: dict[str, dict] = json.loads(found or "{}")
    if not pending:
        return

    async def finish(path: str, record: dict) -> None:
        log.info("finishing the commit of /%s that the last mount began", path)
        request = {**record, "path": path, "timeout": record.get("timeout") or RESUMED_TIMEOUT}
        try:
            result = await commit_request(daemon, request, no_progress)
        except Exception as exc:  # (logged: nobody waits for it)
            log.error("the commit of /%s that the last mount began did not finish: %s; "
                      "run lakefs-mount commit again", path, exc)
            return
        log.info("finished the commit of /%s: manifest %s", path, result["manifest"])

    async with trio.open_nursery() as nursery:
        for path, record in pending.items():
            nursery.start_soon(finish, path, record)


async def no_progress(_: dict) -> None:
    return None


async def verify_path(daemon: CommittingMount, path: str) -> dict[str, Any]:
    """`verify MOUNTPOINT PATH`, in the daemon (its credentials, its retries)."""
    path = path.strip("/")
    prefix = daemon.config.prefix + (path + "/" if path else "")
    return (await verify_checkpoint(daemon.store, prefix)).to_json()
