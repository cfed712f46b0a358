"""The mount daemon: the assembled core (fs/assembly.py) served by a FUSE session, with the
control socket, signals and the final flush around it.

`run_mount` is called by the CLI in the (possibly daemonized) mount process. It reports
readiness exactly once: None when the mount is usable, or a message saying why not.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import trio

from lakefs_mount import metrics as m
from lakefs_mount.cache.asyncjournal import AsyncJournal
from lakefs_mount.cache.flusher import FlushFailed
from lakefs_mount.cache.journal import Journal
from lakefs_mount.cache.warmup import WarmProgress, warm_up
from lakefs_mount.concurrency import first_cause
from lakefs_mount.config import (
    MountConfig,
    control_socket_path,
    orphans_dir,
)
from lakefs_mount.daemon.startup import (
    STARTUP_ERRORS,
    StartupError,
    cache_fd_budget,
    prepare,
    startup_failure,
)
from lakefs_mount.fs.assembly import MountCore, assemble
from lakefs_mount.fs.errors import FSError
from lakefs_mount.fuse.native import DeviceError, KernelOps, NativeSession
from lakefs_mount.fuse.pyfuse3_ops import Pyfuse3Session
from lakefs_mount.fuse.splice import advice as splice_advice
from lakefs_mount.fuse.splice import writes_can_splice
from lakefs_mount.namespace.invalidations import Invalidations
from lakefs_mount.ops import sdnotify
from lakefs_mount.ops.control import ControlError, serve_control
from lakefs_mount.ops.dirprogress import DirProgress
from lakefs_mount.ops.metrics_server import MetricsServer
from lakefs_mount.ops.mountpoint import set_kernel_readahead
from lakefs_mount.ops.orphans import DEFAULT_DIR, OrphanUploader, list_orphans
from lakefs_mount.publish.autocommit import RenameCommits
from lakefs_mount.publish.publisher import commit_request, resume_pending_commits, verify_path
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.checksums import probe_endpoint
from lakefs_mount.s3.layout import PartMap
from lakefs_mount.s3.objectstore import ObjectStore, ObjectStoreError
from lakefs_mount.s3.stats import S3Stats, TimedStore
from lakefs_mount.uring import open_engine

log = logging.getLogger(__name__)

KERNEL_READ_AHEAD_KIB = 1024  # = the largest FUSE request (see set_kernel_readahead)
# Writing the attribute indexes at a flush or an unmount: they only save HEADs, so an S3
# that does not take them within this time does not hold the caller up.
INDEX_WRITE_TIMEOUT = 15.0


class Daemon:
    """Everything of one mount that lives in the trio loop."""

    # built by run(), inside the I/O engine's context
    core: MountCore
    orphan_uploader: OrphanUploader
    session: NativeSession | Pyfuse3Session

    def __init__(self, config: MountConfig, store: ObjectStore, journal: Journal) -> None:
        self.config = config
        self.metrics = m.Metrics()
        self.s3_stats = S3Stats()
        self.plain_store = store  # (the checksum probe's, whose rejection is no error)
        self.store = AsyncStore(TimedStore(store, self.s3_stats), self.metrics,
                                max_threads=max(16, config.upload_concurrency * 2))
        self.journal = AsyncJournal(journal)
        self.parts = PartMap(config.part_size)
        # Names this cache's attribute indexes (dirindex): stable across remounts, distinct
        # between caches, so mounts on several nodes never overwrite each other's.
        writer = journal.get_meta("index_writer")
        if writer is None:
            writer = uuid.uuid4().hex[:16]
            journal.set_meta("index_writer", writer)
        self.index_writer = writer
        self.started = time.time()
        self.engine_name = "?"
        self.splice_writes = writes_can_splice()
        self.terminated = False  # by a signal: the kernel mount is still there
        self.unmounted = False  # the session has ended; what is left goes to S3, then exit
        self.flush_on_exit = True
        self.exit_status = 0  # 1: it exits before S3 has it all (a second signal, ...)
        self.trio_token: trio.lowlevel.TrioToken | None = None  # set once mounted
        self.metrics_addr: str | None = None  # where /metrics listens, if it does
        self.invalidations = Invalidations()  # remote changes the kernel is told of
        self.dirs = DirProgress(config.prefix)  # per-checkpoint progress (status)

    async def run(self, report_ready: Callable[[str | None], None]) -> None:
        config = self.config
        async with open_engine(config.io_engine) as engine:
            self.engine_name = engine.name
            renames_to_commit = (RenameCommits(self, config.commit_on_rename)
                                 if config.commit_on_rename else None)
            self.core = core = await assemble(
                config, engine, self.store, self.journal, self.metrics,
                writer=self.index_writer, open_files=cache_fd_budget(),
                kernel=self.invalidations, on_uploaded=self.dirs.uploaded,
                on_record=None if renames_to_commit is None else renames_to_commit.noticed)
            self.orphan_uploader = OrphanUploader(self.store, self.parts, config.prefix,
                                                  core.flusher.checksums)
            async with trio.open_nursery() as nursery:
                await core.start(nursery)
                socket_path = control_socket_path(config.mountpoint)  # before the mount exists
                self.session = session = await self._open_session()
                served = False  # to its end: the kernel let go, or a signal ended it
                try:
                    await nursery.start(serve_control, socket_path, self)
                    nursery.start_soon(self._signals, nursery.cancel_scope)
                    nursery.start_soon(self._tune_kernel)
                    nursery.start_soon(resume_pending_commits, self)  # a crash left them
                    if not config.read_only:
                        nursery.start_soon(probe_endpoint, self.plain_store, config.prefix,
                                           self.core.flusher.checksums)
                    if renames_to_commit is not None:
                        nursery.start_soon(renames_to_commit.run)
                    log.info("mounted s3://%s/%s at %s (io engine: %s, FUSE session: %s)",
                             config.bucket, config.prefix, config.mountpoint, engine.name,
                             session.name)
                    if session.name == "pyfuse3" and not self.splice_writes:
                        log.info("%s", splice_advice())
                    self.trio_token = trio.lowlevel.current_trio_token()
                    report_ready(None)
                    async with trio.open_nursery() as serving:  # ends before the close
                        serving.start_soon(self.invalidations.run, session)
                        await session.serve()
                        serving.cancel_scope.cancel()
                    served = True
                finally:  # (also interrupted before serving: nothing stays mounted)
                    session.close(unmount=self.terminated or not served)
                    self.unmounted = True
                log.info("unmounted %s", config.mountpoint)
                sdnotify.notify(STOPPING=1, STATUS="unmounted; committing what is left to S3")
                await self._final_flush()
                await self.core.ns.index.write_changed(INDEX_WRITE_TIMEOUT)
                cache = core.cache
                await cache.settle_all()
                await self.journal.write_notes()
                await cache.warm.sweep(cache.data_dir, {  # (by fid: all have one)
                    fid for fid, cf in cache.files.items() if cf.openers})
                nursery.cancel_scope.cancel()

    async def _open_session(self) -> NativeSession | Pyfuse3Session:
        """Mount with the session asked for; `auto` takes the native one where it can
        start (root, a working /dev/fuse) and says why not otherwise."""
        config = self.config
        if config.fuse_session != "pyfuse3":
            native = NativeSession(KernelOps(self.core.fs), config.mountpoint,
                                   allow_other=config.allow_other, read_only=config.read_only,
                                   allow_root=config.allow_root,
                                   probe_dir=self.core.cache.data_dir,
                                   source=config.mount_source)
            try:
                await native.mount()
                return native
            except DeviceError as exc:
                if config.fuse_session == "native":
                    raise StartupError(f"native FUSE session: {exc}") from None
                log.info("FUSE session: pyfuse3, as the native session cannot start: %s", exc)
        session = Pyfuse3Session(self.core.fs, str(config.mountpoint),
                                 allow_other=config.allow_other, read_only=config.read_only,
                                 allow_root=config.allow_root,
                                 source=config.mount_source)
        await session.mount()
        return session

    async def _tune_kernel(self) -> None:
        """Raise the kernel read-ahead once the kernel has our INIT reply (which would
        reset it): a stat() of the mount root from a thread returns only after that."""
        def tune() -> None:
            try:
                os.stat(self.config.mountpoint)
            except OSError as exc:
                log.info("kernel read-ahead not tuned: %s", exc)
                return
            kib = KERNEL_READ_AHEAD_KIB
            if isinstance(self.session, NativeSession):  # its requests may be larger
                kib = max(kib, self.session.max_write // 1024)
            set_kernel_readahead(self.config.mountpoint, kib)

        await trio.to_thread.run_sync(tune, abandon_on_cancel=True)

    async def _final_flush(self) -> None:
        """After the kernel let go: commit what is left unless told not to wait. The
        daemon's exit is what tells that the data is in S3 (README), so an S3 that keeps
        failing is waited for; a second SIGTERM or SIGINT ends the wait (`_signals`)."""
        pending = self.core.fs.pending_files(None)
        if not (pending or self.core.names.ops) or not self.flush_on_exit:
            return
        log.info("committing %d file(s) and %d namespace change(s) before exit",
                 len(pending), len(self.core.names.ops))
        warned = False
        while True:
            try:
                await self.core.fs.flush_files(pending)
                return
            except FlushFailed as exc:
                if not warned:
                    log.warning("not in S3 yet (%s); still trying: a second SIGTERM or "
                                "SIGINT exits now, and the next mount with this cache "
                                "directory uploads the rest", exc)
                    warned = True
            except Exception as exc:
                log.error("not everything reached S3 (%s); the next mount with this cache "
                          "directory uploads the rest", exc)
                self.exit_status = 1
                return
            pending = self.core.fs.pending_files(None)

    async def _signals(self, everything: trio.CancelScope) -> None:
        """The first SIGTERM or SIGINT unmounts, and the daemon uploads what is left
        before it exits; a second one ends that at once (an operator who cannot wait, or
        an S3 that cannot be reached): the journal keeps it for the next mount."""
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if not self.terminated:
                    self.terminated = True
                    if self.unmounted:  # (by umount): it uploads what is left already
                        log.info("signal %d: exiting once what is left is in S3", signum)
                    else:
                        log.info("signal %d: unmounting", signum)
                        self.session.terminate()
                    continue
                pending = self.core.fs.pending_files(None)
                log.warning("signal %d again: exiting without waiting for S3; %d file(s) "
                            "and %d namespace change(s) not yet there are safe in the "
                            "journal; the next mount with this cache directory uploads "
                            "them", signum, len(pending), len(self.core.names.ops))
                self.flush_on_exit = False
                self.exit_status = 1
                everything.cancel()
                self.store.abandon_requests()
                return

    # -- control socket -----------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        cache = self.core.cache
        pending = self.core.fs.pending_files(None)
        return {
            "mountpoint": str(self.config.mountpoint),
            "source": self.config.mount_source,
            "bucket": self.config.bucket,
            "prefix": self.config.prefix,
            "endpoint": self.config.endpoint_url or "AWS S3",
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 1),
            "io_engine": self.engine_name,
            "fuse_session": self.session.name,
            # on/off as JSON booleans, each with why it is off (None when on)
            "passthrough": self.session.passthrough,
            "passthrough_reason": None if self.session.passthrough
            else self.session.passthrough_reason,
            "splice_writes": self.splice_writes,
            "spliced_reads": self.session.spliced_reads,
            "spliced_reads_reason": self.session.spliced_reads_reason or None,
            "dirty_bytes": cache.dirty_bytes,
            "oldest_dirty_s": cache.book.oldest_dirty_age(list(cache.files.values())),
            "max_dirty": cache.max_dirty,
            "files_pending": len(pending),
            # files a crashed daemon's mount may still write (cache.stalewriters)
            "stale_writers": len(cache.stale_writers.files) or None,
            "cache_dir": str(self.config.resolved_cache_dir()),
            "log_file": str(self.config.log_file) if self.config.log_file else None,
            "cache_size": self.config.cache_size,
            "cache_used": await trio.to_thread.run_sync(_disk_usage, cache.data_dir),
            # cache files a crash or a damaged journal left unnamed (warm.py): None if none
            "orphans": await trio.to_thread.run_sync(_disk_usage,
                                                        orphans_dir(cache.data_dir.parent)),
            "bytes_uploaded": self.metrics[m.BYTES_UPLOADED],
            "retries": self.metrics[m.RETRIES],
            "errors": self.metrics[m.ERRORS],
            # a file's upload failing, a namespace change failing, else any S3 request
            # failing now (a lookup's, ...)
            "last_error": next((cf.errors.last for cf in pending if cf.errors.streak),
                               self.core.names.status()["name_changes_error"])
            or self.s3_stats.current_error(),
            **self._s3_under_way(),
            **self.core.flusher.status(),
            **self.core.names.status(),
            **self.core.ns.status(),
            "metrics_addr": self.metrics_addr,
            "s3_requests": self.s3_stats.snapshot(),
            "fuse_requests": self.session.latencies.snapshot(),
            "last_s3_error_at": self.s3_stats.last_error_at,
            "counters": dict(self.metrics),
            **self.dirs.status(pending),  # per top-level directory; commits under way
        }

    def _s3_under_way(self) -> dict[str, Any]:
        """S3 requests under way (s3/stats): `s3_waiting` counts those waiting longer
        than a few seconds, `s3_oldest_request` names the oldest, whose age is also a
        flat number for /metrics (absent when none is under way)."""
        under_way = self.s3_stats.waiting()
        oldest = under_way["s3_oldest_request"]
        if oldest is not None:
            under_way["s3_oldest_request_s"] = oldest["age_s"]
        return under_way

    def status_from_thread(self) -> dict[str, Any] | None:
        """`status` for a thread outside the loop (the /metrics server): computed in the
        loop, so a scrape sees what `status --json` says; None before the mount is up or
        once the loop has ended."""
        if self.trio_token is None:
            return None
        try:
            return trio.from_thread.run(self.status, trio_token=self.trio_token)
        except trio.RunFinishedError:
            return None

    async def flush(self, path: str | None, progress: Callable[[dict], Awaitable[None]],
                    *, must_exist: bool = True) -> dict[str, Any]:
        """Everything at or under `path` in S3; `must_exist`: a path that is not there
        (nothing pending, no change of it pending or landed lately) fails."""
        files = self.core.fs.pending_files(path)
        if must_exist and path and not files and not self.core.fs.changed_at(path):
            try:  # a typo'd path must not look flushed
                await self.core.fs.node_at(path)
            except FSError as exc:
                raise ValueError(f"flush: {exc}") from None
        started = time.monotonic()

        async def report(p: Any) -> None:
            await progress({"files_left": p.files_left, "bytes_left": p.bytes_left,
                            # only errors since this flush began: S3 may be back
                            "last_error": p.last_error
                            or self.s3_stats.current_error(since=started),
                            "waiting_on": self.s3_stats.waiting_on()})

        await self.core.fs.flush_files(files, on_progress=report, path=path)
        await self.core.ns.index.write_changed(INDEX_WRITE_TIMEOUT)  # other mounts: no HEADs
        return {"files": len(files), "seconds": round(time.monotonic() - started, 3)}

    async def warmup(self, path: str | None,
                     progress: Callable[[dict], Awaitable[None]]) -> dict[str, Any]:
        started = time.monotonic()
        try:
            files, local = await self.core.fs.remote_files_at(path)
        except FSError as exc:
            raise ValueError(str(exc)) from None

        async def report(p: WarmProgress) -> None:
            await progress({"files_left": p.files_left, "bytes_left": p.bytes_left,
                            "bytes_total": p.bytes_to_fetch,
                            "waiting_on": self.s3_stats.waiting_on()})

        try:
            done = await warm_up(self.core.cache, files, report)
        except (ObjectStoreError, OSError) as exc:  # S3 after its retries, the cache disk
            log.warning("warm-up of /%s stopped: %s", path or "", exc)
            raise ValueError(f"{exc} (what was fetched stays cached)") from exc
        seconds = round(time.monotonic() - started, 3)
        log.info("warm-up of /%s: %d files, %d bytes (%d fetched) in %.1f s; %d with local "
                 "changes skipped", path or "", done.files, done.bytes_total,
                 done.fetched_bytes, seconds, local)
        return {"files": done.files, "bytes": done.bytes_total,
                "fetched_bytes": done.fetched_bytes, "local_files": local,
                "seconds": seconds}

    async def orphans(self, upload: bool, to: str | None, keep: bool,
                      progress: Callable[[dict], Awaitable[None]]) -> dict[str, Any]:
        """List the orphaned cache files (D20), or upload them under `to` (a directory
        of the mount) and remove each one S3 confirms, unless `keep`."""
        directory = orphans_dir(self.core.cache.data_dir.parent)
        found = await trio.to_thread.run_sync(list_orphans, directory)
        result: dict[str, Any] = {"dir": str(directory),
                                  "orphans": [o.describe() for o in found]}
        if not upload:
            return result
        to = DEFAULT_DIR if to is None else to.strip("/")
        report = await self.orphan_uploader.upload_all(found, to, keep, progress)
        return {**result, "to": to, "uploaded": report.uploaded, "failed": report.failed}

    async def commit(self, request: dict, progress: Callable[[dict], Awaitable[None]]
                     ) -> dict[str, Any]:
        return await commit_request(self, request, progress)  # (publish/publisher.py)

    async def verify(self, path: str) -> dict[str, Any]:
        return await verify_path(self, path)

    async def prepare_unmount(self, flush: bool,
                              progress: Callable[[dict], Awaitable[None]]) -> dict[str, Any]:
        """The flush of an unmount reports its progress as a flush does: an unmount that
        waits for a slow S3 says what it waits for."""
        if flush:
            await self.flush(None, progress)
        else:
            self.flush_on_exit = False
        return {"pid": os.getpid()}


def _disk_usage(directory: Path) -> int | None:
    """Bytes the cache files take on disk; None if the directory is gone (removed under
    a running mount). A stat per file: run it in a thread, not in the loop."""
    total = 0
    try:
        with os.scandir(directory) as it:
            for e in it:
                try:
                    total += e.stat().st_blocks * 512
                except FileNotFoundError:
                    pass
    except FileNotFoundError:
        return None
    return total


def run_mount(config: MountConfig, report_ready: Callable[[str | None], None]) -> int:
    """Mount and serve until unmounted; returns the process exit code."""
    reported = False

    def ready_once(error: str | None) -> None:
        nonlocal reported
        if not reported:
            reported = True
            report_ready(error)
            notify_ready(config, error)

    with ExitStack() as stack:
        try:
            store, journal = prepare(config, stack)
        except STARTUP_ERRORS as exc:
            message = startup_failure(exc, config)
            log.error("mount failed: %s", message)
            ready_once(message)
            return 1
        daemon = Daemon(config, store, journal)
        if config.metrics_addr is not None:
            try:
                server = MetricsServer(config.metrics_addr, daemon.status_from_thread)
            except OSError as exc:
                log.error("mount failed: %s", exc.strerror)
                ready_once(exc.strerror)
                return 1
            stack.callback(server.close)
            daemon.metrics_addr = server.address
        try:
            trio.run(daemon.run, ready_once)
        except BaseException as exc:
            cause = first_cause(exc)  # not "Exceptions from Trio nursery (1 sub-exception)"
            if isinstance(cause, KeyboardInterrupt):  # SIGINT before its receiver was up
                log.info("interrupted while starting; nothing is mounted")
                ready_once("interrupted; nothing is mounted")
                return 130
            if isinstance(cause, StartupError | ControlError | ObjectStoreError | OSError):
                log.error("mount failed: %s", cause)
            else:
                log.exception("daemon failed")
            ready_once(f"mount failed: {cause}")
            return 1
    return daemon.exit_status


def notify_ready(config: MountConfig, error: str | None) -> None:
    """Tell systemd (Type=notify) that the mount is usable, or why it failed."""
    if error is None:
        sdnotify.notify(READY=1, STATUS=f"mounted s3://{config.bucket}/{config.prefix} at "
                        f"{config.mountpoint}")
    else:
        sdnotify.notify(STATUS=f"mount failed: {error}")
