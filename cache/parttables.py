"""What each chunk fetched from S3 is checked against before it is served or cached.

A chunk that is the whole object: the CRC-32C S3 keeps for the object (sent with a GET of
the whole object), or the one this mount committed it with. A chunk of a larger object:
its part's CRC in the table the object's metadata names (s3/parttable), read once per
object and kept for later fetches (the tables of what this mount commits are kept at once).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import trio

from lakefs_mount import metrics as m
from lakefs_mount.cache.cachefile import CachedFile
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.layout import META_PARTS, PartMap
from lakefs_mount.s3.parttable import PartTable

log = logging.getLogger(__name__)

KEPT_TABLES = 1024  # tables kept in memory (a few bytes per part: 4 KiB for a 16 GiB file)


class PartTables:
    def __init__(self, store: AsyncStore, parts: PartMap) -> None:
        self.store = store
        self.parts = parts
        self._tables: OrderedDict[str, PartTable | None] = OrderedDict()  # None: absent
        self._loading: dict[str, trio.Event] = {}
        self._named: OrderedDict[tuple[str, str], str | None] = OrderedDict()  # by HEAD

    def keep(self, table_key: str, table: PartTable) -> None:
        """A table this mount wrote: its object's chunks need no GET of it."""
        self._remember(self._tables, table_key, table)

    def known(self, table_key: str | None) -> PartTable | None:
        """The table at `table_key` if it is in memory (no request)."""
        return None if table_key is None else self._tables.get(table_key)

    async def expected_crc(self, cf: CachedFile, idx: int, start: int, end: int) -> int | None:
        """The CRC-32C bytes [start, end) of chunk `idx` of `cf`'s base object must have
        (None: nothing to check them against here; a GET of the whole object is still
        checked against what S3 sends with it)."""
        if start == 0 and end == cf.base.size:
            crc = cf.base.crc
            return crc[1] if crc is not None and crc[0] == cf.base.etag else None
        table_key = await self._table_key(cf)
        if table_key is None:
            return None
        table = await self._table(table_key)
        return None if table is None else table.crc_of(idx, cf.base.size, self.parts.part_size)

    async def _table_key(self, cf: CachedFile) -> str | None:
        """Where the base object's metadata says its table is (a HEAD if the lookup did
        not read its metadata)."""
        if cf.base.meta is not None:
            return cf.base.meta.get(META_PARTS)
        key, etag = cf.base.key, cf.base.etag
        if key is None or etag is None:
            return None
        if (key, etag) not in self._named:
            info = await self.store.head(key)
            named = None if info is None else info.metadata.get(META_PARTS)
            self._remember(self._named, (key, etag), named)
        return self._named.get((key, etag))

    async def _table(self, table_key: str) -> PartTable | None:
        while table_key not in self._tables:
            loading = self._loading.get(table_key)
            if loading is not None:
                await loading.wait()  # another chunk's fetch reads it: share that GET
                continue
            self._loading[table_key] = trio.Event()
            try:
                self._remember(self._tables, table_key, await self._load(table_key))
            finally:
                self._loading.pop(table_key).set()
        return self._tables[table_key]

    async def _load(self, table_key: str) -> PartTable | None:
        """GET the table (checked against S3's CRC of it and its own): CorruptRead after
        the attempts fail, so the chunk's read fails (EIO) rather than go unchecked."""
        def load() -> PartTable | None:
            got = self.store.sync.get(table_key)
            return None if got is None else PartTable.decode(got[1], f"GET {table_key}")

        self.store.metrics[m.GETS] += 1
        table = await self.store.call(load, what=f"GET {table_key}")
        if table is None:
            log.warning("the table of part CRCs %s is missing: the object's parts are "
                        "fetched without a check", table_key)
        return table

    @staticmethod
    def _remember(memo: OrderedDict, key: object, value: object) -> None:
        memo[key] = value
        memo.move_to_end(key)
        while len(memo) > KEPT_TABLES:
            memo.popitem(last=False)
