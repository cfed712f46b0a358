"""The POSIX core (`FileSystem`) driven without a kernel, over the in-memory store: what
a call answers, and what reaches the store once the mount has settled. The same cases run
through a real mount and SeaweedFS in tests/mount/test_posix.py."""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from collections.abc import Awaitable, Callable

import pytest
import trio

from lakefs_mount.fs.errors import FSError
from lakefs_mount.namespace.inode import ROOT_INO
from lakefs_mount.s3.layout import decode_attrs
from lakefs_mount.s3.objectstore import Listing
from tests.fs.core import PREFIX, Core, filesystem
from tests.memstore import MemoryObjectStore

UID, GID = os.getuid(), os.getgid()
W = os.O_WRONLY | os.O_CREAT


async def _write_file(c: Core, parent: int, name: str, data: bytes) -> int:
    fh, attr = await c.fs.create(parent, name, 0o644, W, UID, GID)
    assert await c.fs.write(fh, 0, data) == len(data)
    await c.fs.release(fh)
    return attr.ino


async def _read_file(c: Core, ino: int, size: int = 1 << 20) -> bytes:
    fh = await c.fs.open(ino, os.O_RDONLY)
    try:
        return bytes(await c.fs.read(fh, 0, size))
    finally:
        await c.fs.release(fh)


def _errno(exc: pytest.ExceptionInfo[FSError]) -> int:
    return exc.value.errno


def test_a_written_file_reads_back_and_lands_as_one_object(tmp_path):
    async def body() -> None:
        async with filesystem(tmp_path) as c:
            ino = await _write_file(c, ROOT_INO, "model.pt", b"weights" * 1000)
            assert (await c.fs.getattr(ino)).size == 7000
            assert await _read_file(c, ino) == b"weights" * 1000
            await c.settled()
            assert c.store.objects[PREFIX + "model.pt"].body == b"weights" * 1000
    trio.run(body)


def test_lookup_of_a_missing_name_is_enoent_and_create_of_an_existing_one_eexist(tmp_path):
    async def body() -> None:
        async with filesystem(tmp_path) as c:
            with pytest.raises(FSError) as missing:
                await c.fs.lookup(ROOT_INO, "nothing")
            assert _errno(missing) == errno.ENOENT
            await c.fs.mkdir(ROOT_INO, "step_1", 0o755, UID, GID)
            with pytest.raises(FSError) as exists:
                await c.fs.mkdir(ROOT_INO, "step_1", 0o755, UID, GID)
            assert _errno(exists) == errno.EEXIST
    trio.run(body)


def test_rmdir_of_a_directory_with_a_file_is_enotempty_and_succeeds_once_it_is_empty(tmp_path):
    async def body() -> None:
        async with filesystem(tmp_path) as c:
            d = await c.fs.mkdir(ROOT_INO, "d", 0o755, UID, GID)
            await _write_file(c, d.ino, "f", b"x")
            with pytest.raises(FSError) as full:
                await c.fs.rmdir(ROOT_INO, "d")
            assert _errno(full) == errno.ENOTEMPTY
            await c.fs.unlink(d.ino, "f")
            await c.fs.rmdir(ROOT_INO, "d")
            with pytest.raises(FSError) as gone:
                await c.fs.lookup(ROOT_INO, "d")
            assert _errno(gone) == errno.ENOENT
            await c.settled()
            assert not [k for k in c.store.objects if k.startswith(PREFIX + "d/")]
    trio.run(body)


def test_a_directory_renamed_after_its_files_were_written_moves_them_in_the_store(tmp_path):
    async def body() -> None:
        async with filesystem(tmp_path) as c:
            tmp = await c.fs.mkdir(ROOT_INO, "tmp-step", 0o755, UID, GID)
            for rank in range(3):
                await _write_file(c, tmp.ino, f"rank{rank}.pt", b"r%d" % rank)
            await c.fs.rename(ROOT_INO, "tmp-step", ROOT_INO, "step", 0)
            step = await c.fs.lookup(ROOT_INO, "step")
            rank1 = await c.fs.lookup(step.ino, "rank1.pt")
            assert await _read_file(c, rank1.ino) == b"r1"
            await c.settled()
            keys = {k for k in c.store.objects if k.startswith(PREFIX)}
            assert {PREFIX + f"step/rank{r}.pt" for r in range(3)} <= keys
            assert not [k for k in keys if k.startswith(PREFIX + "tmp-step/")]
    trio.run(body)


def test_readdir_lists_what_was_created_with_its_kind(tmp_path):
    async def body() -> None:
        async with filesystem(tmp_path) as c:
            await c.fs.mkdir(ROOT_INO, "sub", 0o755, UID, GID)
            await _write_file(c, ROOT_INO, "a.bin", b"a")
            await c.fs.symlink(ROOT_INO, "latest", "sub", UID, GID)
            fh = await c.fs.opendir(ROOT_INO)
            listed = {name: attr.mode for name, attr, _ in c.fs.readdir(fh, 0)}
            c.fs.releasedir(fh)
            assert stat.S_ISDIR(listed["sub"]) and stat.S_ISREG(listed["a.bin"])
            assert stat.S_ISLNK(listed["latest"])
            latest = await c.fs.lookup(ROOT_INO, "latest")
            assert await c.fs.readlink(latest.ino) == "sub"
    trio.run(body)


def test_truncate_shrinks_and_grows_with_zeros(tmp_path):
    async def body() -> None:
        async with filesystem(tmp_path) as c:
            ino = await _write_file(c, ROOT_INO, "t", b"0123456789")
            assert (await c.fs.setattr(ino, size=4)).size == 4
            assert (await c.fs.setattr(ino, size=8)).size == 8
            assert await _read_file(c, ino) == b"0123\0\0\0\0"
            await c.settled()
            assert c.store.objects[PREFIX + "t"].body == b"0123\0\0\0\0"
    trio.run(body)


@pytest.mark.parametrize("grow", ["truncate", "write past the end"])
def test_a_committed_file_cut_short_then_grown_holds_zeros_not_its_old_bytes(tmp_path, grow):
    """fsx's case: bytes a truncate cut off a committed file never come back, neither
    fetched from the old object when the file grows again (by truncate or by a write past
    the end) nor copied from it at the next commit."""
    async def body() -> None:
        store = MemoryObjectStore()
        old = bytes(range(256)) * (24 << 12)  # 24 MiB, three 8 MiB parts
        store.put(PREFIX + "f", old, {})
        async with filesystem(tmp_path, store) as c:
            ino = (await c.fs.lookup(ROOT_INO, "f")).ino
            assert (await c.fs.setattr(ino, size=1 << 20)).size == 1 << 20
            if grow == "truncate":
                await c.fs.setattr(ino, size=len(old))
            else:
                fh = await c.fs.open(ino, os.O_WRONLY)
                assert await c.fs.write(fh, len(old) - 4, b"tail") == 4
                await c.fs.release(fh)
            want = old[:1 << 20] + bytes(len(old) - (1 << 20) - 4) + (
                bytes(4) if grow == "truncate" else b"tail")
            assert await _read_file(c, ino, len(old)) == want
            await c.settled()
            assert store.objects[PREFIX + "f"].body == want
    trio.run(body)


def test_rename_noreplace_onto_an_existing_name_is_eexist_and_leaves_both(tmp_path):
    async def body() -> None:
        async with filesystem(tmp_path) as c:
            await _write_file(c, ROOT_INO, "a", b"A")
            b = await _write_file(c, ROOT_INO, "b", b"B")
            with pytest.raises(FSError) as clash:
                await c.fs.rename(ROOT_INO, "a", ROOT_INO, "b", 1)  # RENAME_NOREPLACE
            assert _errno(clash) == errno.EEXIST
            assert await _read_file(c, b) == b"B"
    trio.run(body)


def test_an_unlinked_file_stays_readable_through_its_open_handle(tmp_path):
    async def body() -> None:
        async with filesystem(tmp_path) as c:
            ino = await _write_file(c, ROOT_INO, "open.bin", b"still here")
            fh = await c.fs.open(ino, os.O_RDONLY)
            await c.fs.unlink(ROOT_INO, "open.bin")
            assert bytes(await c.fs.read(fh, 0, 100)) == b"still here"
            await c.fs.release(fh)
            await c.settled()
            assert PREFIX + "open.bin" not in c.store.objects
    trio.run(body)


def test_objects_already_in_the_store_are_listed_looked_up_and_read(tmp_path):
    async def body() -> None:
        store = MemoryObjectStore()
        store.put(PREFIX + "step_7/model.pt", b"from another node", {})
        async with filesystem(tmp_path, store) as c:
            step = await c.fs.lookup(ROOT_INO, "step_7")
            assert stat.S_ISDIR(step.mode)
            fh = await c.fs.opendir(step.ino)
            assert [name for name, _, _ in c.fs.readdir(fh, 0)] == ["model.pt"]
            c.fs.releasedir(fh)
            model = await c.fs.lookup(step.ino, "model.pt")
            assert await _read_file(c, model.ino) == b"from another node"
            with pytest.raises(FSError) as full:
                await c.fs.rmdir(ROOT_INO, "step_7")
            assert _errno(full) == errno.ENOTEMPTY
    trio.run(body)


def test_mode_owner_and_mtime_travel_as_object_metadata(tmp_path):
    async def body() -> None:
        async with filesystem(tmp_path) as c:
            ino = await _write_file(c, ROOT_INO, "meta.bin", b"m")
            await c.fs.setattr(ino, mode=0o600, uid=1234, gid=5678, mtime_ns=1_700_000_000 * 10**9)
            await c.settled()
            attrs = decode_attrs(c.store.objects[PREFIX + "meta.bin"].metadata)
            assert (attrs.mode & 0o7777, attrs.uid, attrs.gid) == (0o600, 1234, 5678)
            assert attrs.mtime_ns == 1_700_000_000 * 10**9
    trio.run(body)


def test_a_file_used_as_a_directory_is_enotdir_and_a_directory_opened_is_eisdir(tmp_path):
    async def body() -> None:
        async with filesystem(tmp_path) as c:
            f = await _write_file(c, ROOT_INO, "plain", b"p")
            with pytest.raises(FSError) as notdir:
                await c.fs.mkdir(f, "sub", 0o755, UID, GID)
            assert _errno(notdir) == errno.ENOTDIR
            d = await c.fs.mkdir(ROOT_INO, "dir", 0o755, UID, GID)
            with pytest.raises(FSError) as isdir:
                await c.fs.open(d.ino, os.O_RDONLY)
            assert _errno(isdir) == errno.EISDIR
    trio.run(body)


def test_a_write_past_the_end_leaves_a_hole_of_zeros(tmp_path):
    async def body() -> None:
        async with filesystem(tmp_path) as c:
            fh, attr = await c.fs.create(ROOT_INO, "sparse", 0o644, W, UID, GID)
            await c.fs.write(fh, 0, b"head")
            await c.fs.write(fh, 1 << 20, b"tail")
            await c.fs.release(fh)
            data = await _read_file(c, attr.ino, 2 << 20)
            assert data[:4] == b"head" and data[-4:] == b"tail" and len(data) == (1 << 20) + 4
            assert data[4:1 << 20] == bytes((1 << 20) - 4)
    trio.run(body)


def test_rename_over_an_existing_file_replaces_it_in_the_store(tmp_path):
    async def body() -> None:
        async with filesystem(tmp_path) as c:
            await _write_file(c, ROOT_INO, "ckpt.tmp", b"new")
            await _write_file(c, ROOT_INO, "ckpt", b"old")
            await c.settled()
            await c.fs.rename(ROOT_INO, "ckpt.tmp", ROOT_INO, "ckpt", 0)
            await c.settled()
            assert c.store.objects[PREFIX + "ckpt"].body == b"new"
            assert PREFIX + "ckpt.tmp" not in c.store.objects
    trio.run(body)


def test_hard_links_are_refused_with_eperm(tmp_path):
    async def body() -> None:
        async with filesystem(tmp_path) as c:
            ino = await _write_file(c, ROOT_INO, "a", b"a")
            with pytest.raises(FSError) as refused:
                await c.fs.link(ino, ROOT_INO, "b")
            assert _errno(refused) == errno.EPERM
    trio.run(body)


def test_a_set_group_id_directory_passes_its_group_on(tmp_path):
    """Files, links and directories made in a directory with S_ISGID get its group, and a
    new directory its S_ISGID too (issue 53): a team's shared checkpoint directory."""
    async def body() -> None:
        async with filesystem(tmp_path) as c:
            d = (await c.fs.mkdir(ROOT_INO, "d", 0o775, UID, GID)).ino
            await c.fs.setattr(d, gid=2000, mode=stat.S_IFDIR | 0o2775)
            _, f = await c.fs.create(d, "f", 0o644, W, UID, GID)
            sub = await c.fs.mkdir(d, "sub", 0o755, UID, GID)
            link = await c.fs.symlink(d, "l", "f", UID, GID)
            assert (f.gid, link.gid, sub.gid) == (2000, 2000, 2000)
            assert stat.S_IMODE(sub.mode) == 0o2755
            deeper = await c.fs.create(sub.ino, "g", 0o644, W, UID, GID)
            assert deeper[1].gid == 2000  # (sub is set-group-ID in its turn)
            plain = await c.fs.mkdir(ROOT_INO, "plain", 0o755, UID, GID)
            _, h = await c.fs.create(plain.ino, "h", 0o644, W, UID, GID)
            assert (h.gid, stat.S_IMODE(plain.mode)) == (GID, 0o755)
    trio.run(body)


def test_an_atime_set_is_kept_and_ctime_is_the_time_of_the_change(tmp_path):
    """utimensat keeps the atime it is given (reads do not change it: noatime), and ctime
    is when the change was made, never the time utimensat gave (issue 53); a file's both
    travel as object metadata (atime, ctime) to the next mount."""
    atime, mtime = 1_900_000_000 * 10**9, 1_950_000_000 * 10**9
    store = MemoryObjectStore()

    async def body() -> None:
        async with filesystem(tmp_path / "a", store) as c:
            ino = await _write_file(c, ROOT_INO, "f", b"x")
            before = time.time_ns()
            attr = await c.fs.setattr(ino, atime_ns=atime, mtime_ns=mtime)
            assert (attr.atime_ns, attr.mtime_ns) == (atime, mtime)
            assert before <= attr.ctime_ns <= time.time_ns()
            assert await _read_file(c, ino) == b"x"
            assert (await c.fs.getattr(ino)).atime_ns == atime
            d = (await c.fs.mkdir(ROOT_INO, "d", 0o755, UID, GID)).ino
            dattr = await c.fs.setattr(d, mtime_ns=mtime)
            assert dattr.mtime_ns == dattr.atime_ns == mtime and dattr.ctime_ns < mtime
            ctime = attr.ctime_ns
            await c.settled()
            attrs = decode_attrs(c.store.objects[PREFIX + "f"].metadata)
            assert (attrs.atime_ns, attrs.mtime_ns, attrs.ctime_ns) == (atime, mtime, ctime)
            fh = await c.fs.open(ino, os.O_WRONLY)
            await c.fs.write(fh, 0, b"y")  # a write: mtime and ctime now, atime kept
            await c.fs.release(fh)
            written = await c.fs.getattr(ino)
            assert written.atime_ns == atime and ctime <= written.ctime_ns == written.mtime_ns
            await c.settled()
        async with filesystem(tmp_path / "b", store) as c:  # another mount: the same times
            again = await c.fs.lookup(ROOT_INO, "f")
            assert (again.atime_ns, again.mtime_ns, again.ctime_ns) == (
                written.atime_ns, written.mtime_ns, written.ctime_ns)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    trio.run(body)



class _LateStore(MemoryObjectStore):
    """A store whose CopyObject waits for `release` (a rename's move in S3 under way),
    and whose listings, once `hold_listings` is set, answer what the store held when they
    were sent only after `answer` is set (an S3 that is slow to list)."""

    def __init__(self) -> None:
        super().__init__()
        self.release, self.copying = threading.Event(), threading.Event()
        self.hold_listings, self.listed, self.answer = (threading.Event(), threading.Event(),
                                                        threading.Event())

    def copy(self, src: str, dst: str, metadata: dict[str, str] | None = None) -> str:
        self.copying.set()
        self.release.wait(30)
        return super().copy(src, dst, metadata)

    def list_dir(self, prefix: str) -> Listing:
        listing = super().list_dir(prefix)
        if self.hold_listings.is_set():
            self.listed.set()
            self.answer.wait(30)
        return listing


async def _when(event: threading.Event) -> None:
    assert await trio.to_thread.run_sync(event.wait, 30)


async def _ls_answered_late(c: Core, store: _LateStore,
                            meanwhile: Callable[[], Awaitable[None]]) -> dict[str, int]:
    """`ls -l` of the root whose listing S3 answers only after `meanwhile` ran, as it was
    when `ls` asked: the sizes it shows."""
    store.hold_listings.set()
    async with trio.open_nursery() as nursery:
        opened: list[int] = []

        async def ls() -> None:
            opened.append(await c.fs.opendir(ROOT_INO))

        nursery.start_soon(ls)
        await _when(store.listed)
        await meanwhile()
        store.answer.set()
    sizes = {name: attr.size for name, attr, _ in c.fs.readdir(opened[0], 0)}
    c.fs.releasedir(opened[0])
    return sizes


@pytest.mark.parametrize("listed", ["before the move lands", "as the move lands",
                                    "sent before the move, answered after"])
def test_a_listing_of_the_old_target_never_undoes_a_rename_over_it(tmp_path, listed):
    """`rename(tmp, ckpt)` over a committed `ckpt`: a listing that shows the old `ckpt`
    (S3 has not moved the object yet, or had not when it was asked) must not make the
    name serve the bytes it replaced."""
    async def body() -> None:
        store = _LateStore()
        async with filesystem(tmp_path, store, ttl=0.0) as c:
            await _write_file(c, ROOT_INO, "ckpt.tmp", b"new")
            await _write_file(c, ROOT_INO, "ckpt", b"old content")
            await c.settled()
            await c.fs.rename(ROOT_INO, "ckpt.tmp", ROOT_INO, "ckpt", 0)
            await _when(store.copying)
            if listed == "sent before the move, answered after":
                async def move_lands() -> None:
                    store.release.set()
                    await c.settled()
                assert await _ls_answered_late(c, store, move_lands) == {"ckpt": 3}
                gets = store.calls["get"] + store.calls["get_range"]
                attr = await c.fs.lookup(ROOT_INO, "ckpt")
                assert (attr.size, await _read_file(c, attr.ino)) == (3, b"new")
                assert store.calls["get"] + store.calls["get_range"] == gets  # still cached
            if listed == "as the move lands":
                store.release.set()
            attr = await c.fs.lookup(ROOT_INO, "ckpt")  # (ttl 0: lists the directory)
            assert (attr.size, await _read_file(c, attr.ino)) == (3, b"new")
            store.release.set()
            await c.settled()
            attr = await c.fs.lookup(ROOT_INO, "ckpt")
            assert (attr.size, await _read_file(c, attr.ino)) == (3, b"new")
            assert c.store.objects[PREFIX + "ckpt"].body == b"new"
    trio.run(body)


def test_a_listing_sent_before_a_commit_landed_never_brings_the_old_version_back(tmp_path):
    async def body() -> None:
        store = _LateStore()
        async with filesystem(tmp_path, store, ttl=0.0) as c:
            ino = await _write_file(c, ROOT_INO, "ckpt", b"old content")
            await c.settled()
            fh = await c.fs.open(ino, os.O_WRONLY | os.O_TRUNC)
            await c.fs.write(fh, 0, b"new")
            await c.fs.release(fh)
            assert await _ls_answered_late(c, store, c.settled) == {"ckpt": 3}
            gets = store.calls["get"] + store.calls["get_range"]
            attr = await c.fs.lookup(ROOT_INO, "ckpt")
            assert (attr.size, await _read_file(c, attr.ino)) == (3, b"new")
            assert store.calls["get"] + store.calls["get_range"] == gets  # still cached
    trio.run(body)


@pytest.mark.parametrize("then", ["unlink", "rename away"])
def test_a_file_renamed_over_a_committed_one_and_removed_before_its_commit_leaves_neither(
        tmp_path, then):
    """`mv new ckpt` over a committed `ckpt` while `new` is not in S3 yet, then `rm ckpt`
    (or `mv ckpt elsewhere`) before it commits: the old object must not stay in S3 under
    `ckpt`, where a remount would show the file that was replaced."""
    async def body() -> None:
        async with filesystem(tmp_path) as c:
            await _write_file(c, ROOT_INO, "ckpt", b"old content")
            await c.settled()
            fh, _ = await c.fs.create(ROOT_INO, "new", 0o644, W, UID, GID)
            await c.fs.write(fh, 0, b"new")  # still open: not committed
            await c.fs.rename(ROOT_INO, "new", ROOT_INO, "ckpt", 0)
            if then == "unlink":
                await c.fs.unlink(ROOT_INO, "ckpt")
            else:
                await c.fs.rename(ROOT_INO, "ckpt", ROOT_INO, "elsewhere", 0)
            await c.fs.release(fh)
            await c.settled()
            expected = {} if then == "unlink" else {PREFIX + "elsewhere": b"new"}
            assert {k: o.body for k, o in c.store.objects.items()
                    if not k.startswith(PREFIX + ".lakefs-mount")} == expected
    trio.run(body)
