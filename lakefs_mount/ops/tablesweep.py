"""`lakefs-mount sweep-tables`: delete the tables of part CRCs (s3/parttable) that no
object under the prefix names any more.

A mount deletes the table of an object it replaces or removes once that change is in S3
(namelog TABLE). Tables left before (buckets written by older versions, a daemon killed
between a commit landing and its journal, objects the mount removed without knowing
their metadata) are found here: the tables under `PREFIX/.lakefs-mount/parts/` are
listed first, then every object under the prefix large enough to be a multipart upload
is HEADed for the table its metadata names (bounded concurrency, the listing read a page
at a time). A table is deleted only if no object names it and it is older than the grace
period, as S3's LastModified says at the listing and again just before its DELETE: a
table is written with every CompleteMultipartUpload attempt of its object, so one whose
object is still being committed is young. Any HEAD that fails ends the sweep before it
deletes anything.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import trio

from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.layout import META_PARTS, MIN_PART_SIZE, RESERVED_NAME
from lakefs_mount.s3.objectstore import ObjectInfo
from lakefs_mount.s3.parttable import FOLDER

log = logging.getLogger(__name__)

PAGE = 1000  # listed objects taken from the listing's thread at a time
DEFAULT_GRACE = 3600.0  # seconds


@dataclass
class SweepReport:
    tables: int = 0  # under PREFIX/.lakefs-mount/parts/ when the sweep began
    objects_headed: int = 0  # objects large enough to name one
    named: int = 0  # tables some object names
    young: int = 0  # named by none, but within the grace period: kept
    deleted: list[str] = field(default_factory=list)  # (or that would be, dry run)
    dry_run: bool = False

    def to_json(self) -> dict[str, object]:
        return {"tables": self.tables, "objects_headed": self.objects_headed,
                "named": self.named, "young": self.young, "deleted": len(self.deleted),
                "dry_run": self.dry_run, "deleted_keys": self.deleted}


async def sweep_tables(store: AsyncStore, prefix: str, grace: float = DEFAULT_GRACE,
                       parallel: int = 16, dry_run: bool = False) -> SweepReport:
    report = SweepReport(dry_run=dry_run)
    began = time.time()
    tables = {o.key: o.mtime for o in await store.list_recursive(prefix + FOLDER)}
    report.tables = len(tables)
    if not tables:
        return report
    named = await _named_tables(store, prefix, parallel, report)
    report.named = len(named & tables.keys())
    for key in sorted(tables.keys() - named):
        if began - tables[key] < grace or not await _still_old(store, key, grace):
            report.young += 1
            continue
        if not dry_run:
            await store.delete(key)
        report.deleted.append(key)
    log.info("sweep of %s: %d tables, %d named, %d young, %d %s", prefix + FOLDER,
             report.tables, report.named, report.young, len(report.deleted),
             "to delete (dry run)" if dry_run else "deleted")
    return report


async def _named_tables(store: AsyncStore, prefix: str, parallel: int,
                        report: SweepReport) -> set[str]:
    """The tables that the objects under `prefix` name (the mount's own records aside)."""
    named: set[str] = set()
    reserved = prefix + RESERVED_NAME + "/"
    objects: Iterator[ObjectInfo] = store.sync.list_recursive(prefix)
    slots = trio.Semaphore(parallel)  # HEADs under way; the listing waits for a free one

    async def head(key: str) -> None:
        try:
            info = await store.head(key)
        finally:
            slots.release()
        report.objects_headed += 1
        table = None if info is None else info.metadata.get(META_PARTS)
        if table is not None:
            named.add(table)

    try:
        async with trio.open_nursery() as nursery:
            while page := await trio.to_thread.run_sync(
                    lambda: list(itertools.islice(objects, PAGE))):
                for obj in page:  # (a multipart object the mount wrote has 2 parts or more)
                    if obj.size > MIN_PART_SIZE and not obj.key.startswith(reserved):
                        await slots.acquire()
                        nursery.start_soon(head, obj.key)
    except ExceptionGroup as group:  # a HEAD failed: nothing is deleted
        raise group.exceptions[0] from group
    return named


async def _still_old(store: AsyncStore, key: str, grace: float) -> bool:
    """The table is still there and older than `grace` (a commit attempt of its object
    writes it again)."""
    info = await store.head(key)
    return info is not None and time.time() - info.mtime >= grace
