"""Changes made behind the mount (another writer, with boto3) reach what the kernel caches:
when a listing finds an object changed or gone, the daemon tells the kernel at once
(FUSE_NOTIFY_INVAL_INODE / INVAL_ENTRY; pyfuse3.invalidate_*), instead of leaving the
old size, pages and name in place until the kernel's own timeout (ATTR_TIMEOUT) ends.
Real mounts, real SeaweedFS, both FUSE sessions.

Each case caches a name in the kernel at a known moment (everything older has expired),
changes S3, has a lookup of another name list the directory after the metadata TTL, and
expects the change to show before the kernel's timeout of that moment would end. On a
machine too slow to get there in time the case is tried again."""

from __future__ import annotations

import os
import time

import pytest

from lakefs_mount.fs.filesystem import ATTR_TIMEOUT

TTL = 0.5  # --metadata-ttl: the daemon lists the directory again after this
ATTEMPTS = 5
pytestmark = pytest.mark.parametrize("fuse_session", ["native", "pyfuse3"], indirect=True)


def _within_the_kernels_timeout(m, cache_it, change, seen) -> None:
    """`cache_it` has the kernel cache a name at t0; `change` changes S3; a lookup after
    the TTL relists the directory; `seen` must hold before t0 + ATTR_TIMEOUT."""
    for attempt in range(ATTEMPTS):
        time.sleep(ATTR_TIMEOUT + 0.2)  # the kernel's cached names and attributes expire
        t0 = time.monotonic()
        cache_it()
        change(attempt)
        time.sleep(max(0.0, t0 + TTL + 0.1 - time.monotonic()))
        assert not (m.path / "d" / f"probe{attempt}").exists()  # a lookup: lists d again
        while time.monotonic() < t0 + ATTR_TIMEOUT - 0.05:
            if seen(attempt):
                return
            time.sleep(0.01)
    pytest.fail(f"the change did not show before the kernel's timeout in {ATTEMPTS} tries")


def test_an_object_rewritten_behind_the_mount_shows_its_new_content_at_the_next_listing(
        mount_factory, s3):
    s3.put("d/f.txt", b"version one", {})
    m = mount_factory("--metadata-ttl", str(TTL))
    path = m.path / "d" / "f.txt"
    assert path.read_bytes() == b"version one"
    bodies = [b"version two, longer" + b"!" * i for i in range(ATTEMPTS)]  # sizes differ

    def cache_it() -> None:  # size and attributes (a read would have the next stat ask
        assert path.stat().st_size in (len(b"version one"), *map(len, bodies))  # again)

    def seen(i: int) -> bool:  # stat first: an open would refresh the size by itself
        return path.stat().st_size == len(bodies[i]) and path.read_bytes() == bodies[i]

    _within_the_kernels_timeout(m, cache_it, lambda i: s3.put("d/f.txt", bodies[i], {}), seen)


def test_an_object_deleted_behind_the_mount_is_gone_at_the_next_listing(mount_factory, s3):
    m = mount_factory("--metadata-ttl", str(TTL))
    os.makedirs(m.path / "d", exist_ok=True)
    names = [f"gone{i}" for i in range(ATTEMPTS)]
    for name in names:
        s3.put(f"d/{name}", b"here for now", {})
    current = iter(names)
    name = ""

    def cache_it() -> None:  # the name in the kernel's dentry cache
        nonlocal name
        name = next(current)
        assert (m.path / "d" / name).stat().st_size == len(b"here for now")

    _within_the_kernels_timeout(
        m, cache_it, lambda i: s3.delete(f"d/{name}"),
        lambda i: not (m.path / "d" / name).exists())
