"""O_DIRECT cache-file I/O: what bypasses the page cache, and the buffers it lends.

Restores through a real mount read these paths end to end in tests/mount/test_restore.py.
"""

from __future__ import annotations

import random

from lakefs_mount.cache.partbody import CachePartBody
from tests.unit.test_cache import PART, core, run
from tests.unit.test_direct import cached_pages

MiB = 1 << 20


def test_parts_go_from_the_cache_file_to_s3_in_pieces_skipping_the_page_cache(
        tmp_path, s3, monkeypatch):
    """Against SeaweedFS: each UploadPart body goes out in the pieces read into the
    uploading thread's aligned buffer with O_DIRECT (never read whole, the page cache
    stays empty but for the unaligned tail), and S3 gets every byte."""
    def whole_read(self, size=-1):
        raise AssertionError("the part body was read instead of sent in pieces")

    monkeypatch.setattr(CachePartBody, "read", whole_read)
    data = random.randbytes(PART + 2 * MiB + 300 * 1024 + 123)  # the 2nd part unaligned

    async def body() -> None:
        async with core(tmp_path, s3) as c:
            cf = await c.write_file("ckpt", data)
            assert cf.chunks[0].direct and cf.chunks[1].direct
            path = c.cache.cachefiles.path(cf.fid)
            await c.close_and_flush(cf)
            assert cached_pages(path) <= 2
    run(body)
    got = s3.get("ckpt")
    assert got is not None and got[1] == data


