"""Opens the kernel serves from the cache file itself (FUSE passthrough), and how the cache
learns what a passthrough writer changed.

Which opens: an open of a file whose every byte is in the cache (new, truncated, fully
cached), when no open of it goes through the daemon; then every further open of the file
is passthrough too, as the kernel requires, until the last one is released. Writers also
need room under --max-dirty at open; otherwise they take the daemon path, which waits.

While a file has passthrough writers its chunk map does not say what the cache file holds.
So the journal row carries `passthrough = 1` from before the first such open is answered
until `sync` has brought the chunks in line with the cache file (one transaction); a crash
in between makes recovery treat the whole cache file as dirty (docs/durability.md, D21).
The attributes the kernel asks for come from the cache file meanwhile (`refresh`).

The daemon never sees the writes, so it watches (`run`): every WATCH_EVERY seconds it
stats the cache file of each file being written, and hands the chunks that lie wholly
behind its end (or its first hole: a file whose size was set first) to the flusher, which
uploads them while the writer goes on and remembers the CRC-32C of what each part sent.
When the last writer leaves, the commit keeps a part whose CRC still matches the cache
file; every other chunk goes up (again). So a sequential writer is durable about as soon
as its tail is uploaded, and a writer that goes back (random overwrites, a header
rewritten at the end) still commits exactly what it wrote.

The daemon path makes a writer wait at --max-dirty and while the cache disk has no room;
a passthrough writer is held at the same bounds by the kernel itself (`cache.writegate`):
its cache file is marked before its open is answered, the mark speaks up once the cache
comes NEAR a bound, and past it every access of the marked files by another process waits
until uploads (or eviction) bring the cache back under it. Where nothing but the writers'
own open files fills the cache (clean chunks of open files cannot be evicted, and parts of
an upload not yet complete cannot be read back from S3), they go on: one file larger than
the cache fills it as far as the disk allows, in passthrough as through the daemon.

Streaming needs CPU (the CRC pass, the send), and so does the S3 server where it shares
the machine. While the writers alone keep every core busy (as many writing at least
BUSY_WRITER bytes a second as the daemon has cores, as DCP's writer threads can),
streaming would only slow them down, so their parts wait until the cores are free again
or the files are closed (`WritersFirst`); for HOLD_AT_MOST seconds at most, so that
the bytes that only the cache holds stay bounded when the writers go on. Held back, such
a save takes as long as on the local disk; streamed meanwhile, it takes markedly longer.
"""

from __future__ import annotations

import errno
import logging
import os
import weakref

import trio

from lakefs_mount import metrics as m
from lakefs_mount.cache.cachefile import CachedFile, ChunkState
from lakefs_mount.cache.cachefiles import CacheFiles
from lakefs_mount.cache.chunkbook import ChunkBook
from lakefs_mount.cache.diskroom import DiskRoom
from lakefs_mount.cache.reader import Reader
from lakefs_mount.cache.spills import short_of_room
from lakefs_mount.cache.writegate import WriteGate
from lakefs_mount.cache.writer import Writer
from lakefs_mount.config import HooksForTests
from lakefs_mount.s3.layout import MAX_OBJECT_SIZE, PartMap

log = logging.getLogger(__name__)

WATCH_EVERY = 0.1  # seconds between looks at the cache files being written
BUSY_WRITER = 64 << 20  # bytes a second: a writer at least this fast keeps a core busy
CALM_AFTER = 0.3  # seconds the cores stay free before streaming goes on again
HOLD_AT_MOST = 5.0  # seconds of busy writers after which streaming goes on all the same
NEAR = 0.75  # of --max-dirty: from here on the writers' marks speak up
FAST_PACE = 2 << 30  # bytes a second a writer may add before the watcher has seen any


class Passthrough:
    def __init__(self, cachefiles: CacheFiles, book: ChunkBook, room: DiskRoom, reader: Reader,
                 writer: Writer, parts: PartMap, metrics: m.Metrics,
                 hooks: HooksForTests) -> None:
        self.cachefiles = cachefiles
        self.book = book
        self.room = room
        self.reader = reader
        self.writer = writer
        self.parts = parts
        self.metrics = metrics
        self.writing: set[CachedFile] = set()  # files with passthrough writers
        self.cores = hooks.cores or len(os.sched_getaffinity(0))
        self.slow_take_over = hooks.slow_take_over
        self._blocks: weakref.WeakKeyDictionary[CachedFile, int] = weakref.WeakKeyDictionary()
        self._blocks_at_open: weakref.WeakKeyDictionary[CachedFile, int] = (
            weakref.WeakKeyDictionary())
        self._first = WritersFirst()
        self._gate: WriteGate | None = None  # opened at the first writer (`_gated`)
        self._gate_tried = False
        self._gate_holds = 0  # the gate's `holds` counted into the metrics so far
        self._loud = False  # whether the writers' marks report accesses now
        self._shut = False  # whether the gate holds every access now (no room at all)
        self._marked: dict[CachedFile, bool] = {}  # files marked -> whether loud
        self._grew = 0  # bytes the writers added to their cache files in the last look
        # one look at a file at a time: the watcher's hand-over of chunks and `sync`
        self._looking: weakref.WeakKeyDictionary[CachedFile, trio.Lock] = (
            weakref.WeakKeyDictionary())

    async def run(self) -> None:
        """Stream what passthrough writers have left behind (see the module's docstring)."""
        looked = trio.current_time()
        try:
            await self._watch(looked)
        finally:
            if self._gate is not None:
                self._gate.close()  # (every access still held goes on)
                self._gate = None

    async def _watch(self, looked: float) -> None:
        while True:
            await trio.sleep(WATCH_EVERY)
            now = trio.current_time()
            busy = self._cores_busy(now - looked)
            looked = now
            await self._make_disk_room()
            self._steer_gate()  # (near a bound, the writers wait and streaming goes on)
            held = self._first.holds(now, busy) and not self._loud
            if held:
                self.metrics[m.STREAMING_HELD] += 1
                continue
            for cf in list(self.writing):
                try:
                    await self._stream(cf)
                except OSError as exc:  # a full disk, a vanished file: the last close syncs
                    log.warning("watching %s: %s", cf.key, exc)

    async def _make_disk_room(self) -> None:
        """Evict clean chunks before the kernel needs their room: it writes into the
        cache files itself, and a full disk fails its write at once (ENOSPC), where the
        daemon path evicts first. Kept free: a part, and what the writers added in the
        last three looks (a quarter of --max-dirty at least); the gate holds them where
        this cannot keep up. (Not the gate's whole margin, which assumes FAST_PACE before
        a look: that would evict hundreds of MiB of a warm cache at each writer's open.)"""
        if not self.writing:
            return
        try:
            free = self.room.free_above_reserve()
        except OSError:  # (the cache directory removed under the mount: writes will say)
            return
        wanted = self.parts.part_size + max(self._near, 3 * self._grew)
        if free < wanted:
            await self.room.evictor.evict_bytes(wanted - free)

    def _gated(self) -> WriteGate | None:
        """The gate, opened at the first writer; None where the kernel has none, or the
        cache disk's file system reports no pre-content events (then passthrough writers
        are not held: said once)."""
        if not self._gate_tried:
            self._gate_tried = True
            gate = WriteGate()
            try:
                gate.open()
                if not gate.holds_on(self.cachefiles.data_dir):
                    gate.close()
                    raise OSError(errno.EOPNOTSUPP, "the cache directory's file system "
                                  "reports no pre-content events (fanotify)")
            except OSError as exc:
                log.info("passthrough writers cannot be held at --max-dirty: %s (they "
                         "take the daemon path while the cache disk is short of room)",
                         exc)
            else:
                self._gate = gate
                self._steer_gate()
        return self._gate

    def _mark(self, cf: CachedFile, gate: WriteGate) -> None:
        """Before the writer's open is answered: its accesses can be held from now on."""
        if cf in self._marked or cf.fid is None:
            return
        try:
            gate.watch(self.cachefiles.path(cf.fid), self._loud)
        except OSError as exc:  # (this file then goes unheld)
            log.warning("marking %s for holding its writers: %s", cf.key, exc)
            return
        self._marked[cf] = self._loud

    def _unmark(self, cf: CachedFile) -> None:
        if self._marked.pop(cf, None) is not None and self._gate is not None \
                and cf.fid is not None:
            self._gate.unwatch(self.cachefiles.path(cf.fid))

    def _steer_gate(self) -> None:
        """What other processes may still write into the marked files before they wait:
        the room left under --max-dirty and on the cache disk; marks loud near either
        bound, quiet otherwise (each access reported costs a round trip to the gate's
        thread)."""
        gate = self._gate
        if gate is None:
            return
        room = self._headroom()
        # loud, the marks stay loud until the writers are far from the bound
        far = self.book.max_dirty - self._near
        loud = room is not None and (room < self._margin() or self._loud and room < far)
        self._shut = room == 0
        if self._shut:
            self.book.demand.pressure()  # every full dirty chunk goes up now
        gate.admit(room)  # (a quiet mark reports nothing: only loud ones count it down)
        if gate.holds != self._gate_holds:
            self.metrics[m.PASSTHROUGH_WRITES_HELD] += gate.holds - self._gate_holds
            self._gate_holds = gate.holds
        for cf, was in list(self._marked.items()):
            if cf.fid is None or was == loud:
                continue
            try:
                gate.speak(self.cachefiles.path(cf.fid), loud)
            except OSError as exc:  # (a file gone meanwhile)
                log.debug("marking %s: %s", cf.key, exc)
            else:
                self._marked[cf] = loud
        self._loud = loud

    def _headroom(self) -> int | None:
        """Bytes writers may add before the daemon path would make them wait: under
        --max-dirty and free on the cache disk now (a part kept free; clean chunks count
        once evicted, `_make_disk_room`). None when there is none and nothing drains (no
        upload under way or queued, no whole part to hand over, nothing to evict):
        waiting could not end, and the writers go on, as on the daemon path."""
        unsent = self._not_handed_over()
        dirty = self.book.max_dirty - self.book.dirty_bytes - unsent
        try:
            disk = self.room.free_above_reserve() - self.parts.part_size
        except OSError:  # (the cache directory removed under the mount: writes will say)
            disk = dirty
        room = max(0, min(dirty, disk))
        if (not room and unsent < self.parts.part_size and not self.book.demand.busy()
                and not (disk <= 0 < self.book.budget.clean_bytes(self.writing))):
            return None
        return room

    def _not_handed_over(self) -> int:
        """Bytes the writers added to their cache files since their open that no chunk
        handed to the flusher counts yet (the watcher hands over only whole chunks, and
        none while the writers keep every core busy)."""
        total = 0
        for cf in self.writing:
            grown = self._blocks.get(cf, 0) - self._blocks_at_open.get(cf, 0)
            handed = sum(ch.held for idx in cf.pt.streamed
                         if (ch := cf.chunks.get(idx)) and ch.state is not ChunkState.CLEAN)
            total += max(0, grown - handed)
        return total

    def _margin(self) -> int:
        """Room below which the marks speak up. Quiet, the writers go unheld until the
        next look: only while they cannot reach the bound by then at the last look's
        pace, or at FAST_PACE before any (a look they were held in says nothing of it)."""
        pace = max(self._grew, int(FAST_PACE * WATCH_EVERY))
        return max(self._near, 3 * pace)

    @property
    def _near(self) -> int:
        """Headroom below which the marks speak up (NEAR of --max-dirty)."""
        return int(self.book.max_dirty * (1 - NEAR))

    def _cores_busy(self, seconds: float) -> bool:
        """Whether the passthrough writers alone kept every core busy since the last look:
        each that wrote at least BUSY_WRITER bytes a second (blocks allocated: a writer
        that set the size first fills holes) keeps one core copying."""
        busy = self._grew = 0
        for cf in self.writing:
            if cf.fid is None or cf.unlinked:
                continue
            try:
                blocks = os.stat(self.cachefiles.path(cf.fid)).st_blocks * 512
            except OSError:
                continue
            grew = blocks - self._blocks.get(cf, blocks)
            self._blocks[cf] = blocks
            busy += grew >= BUSY_WRITER * seconds
            self._grew += max(0, grew)
        return busy >= self.cores

    def _look(self, cf: CachedFile) -> trio.Lock:
        """Held while the watcher hands chunks of `cf` to the flusher and while `sync`
        takes the chunk map over: a last close that came in the middle of a hand-over
        took the chunks still being journalled for unsent, marked them dirty again, and
        each part went up twice (three times when the two uploads crossed)."""
        return self._looking.setdefault(cf, trio.Lock())

    async def _stream(self, cf: CachedFile) -> None:
        async with self._look(cf):
            await self._hand_over(cf)

    async def _hand_over(self, cf: CachedFile) -> None:
        if cf.unlinked or cf.fid is None or cf.pt.writers == 0:
            return
        seen = self._stat(cf)
        if seen == cf.pt.watched:
            return
        cf.pt.watched = seen
        self._note_written(cf, seen)
        if seen == cf.pt.seen or seen[0] > MAX_OBJECT_SIZE:  # nothing written since the
            return  # open, or past S3's largest object (no part of it fits; commits say so)
        assert cf.fid is not None  # (a thread: SEEK_HOLE waits for a write() under way)
        written = await trio.to_thread.run_sync(
            _written_up_to, self.cachefiles.path(cf.fid), seen[0], abandon_on_cancel=True)
        # the chunks wholly written and gone past: a file that ends with a chunk is sent
        # whole by its commit (a file of one part: a PutObject, no multipart upload begun
        # and aborted), as on the daemon path; at a bound at once, where the writer may be
        # held right at a chunk's end
        edge = written if self._shut else written - 1
        full = self.parts.chunk_of(edge) if written else 0
        todo = [i for i in range(full) if i not in cf.pt.streamed]
        if todo:
            cf.pt.streamed.update(todo)
            await self.writer.stream_written(cf, todo)

    async def enter(self, cf: CachedFile, writable: bool, daemon_opens: int) -> int | None:
        """A new descriptor of the cache file for the kernel to serve this open from, or
        None when the open must go through the daemon. `daemon_opens`: other opens of the
        file that go through the daemon."""
        if cf.pt.opens == 0 and not self._may_start(cf, writable, daemon_opens):
            return None
        cf.pt.opens += 1  # counted before any await: a concurrent open must follow suit
        if writable:
            cf.pt.writers += 1
            self.writing.add(cf)
        fd = -1
        try:
            fd = self.cachefiles.open_loose(cf)
            st = os.fstat(fd)
            if cf.pt.opens == 1 and st.st_size != cf.size:
                # the kernel reads up to the backing file's end: bytes of an older, longer
                # version past it (or a tail never written) must not show
                os.ftruncate(fd, cf.size)
            if writable:
                self._blocks.setdefault(cf, st.st_blocks * 512)  # its first look counts
                self._blocks_at_open.setdefault(cf, st.st_blocks * 512)
                gate = self._gated()
                if gate is not None:
                    self._mark(cf, gate)
                await self._recorded(cf)
                await self._make_disk_room()
        except BaseException:
            if fd >= 0:
                os.close(fd)
            await self.leave(cf, writable)
            raise
        return fd

    async def adopt_stale(self, cf: CachedFile) -> None:
        """A writer a crashed daemon's mount left on the file (cache.stalewriters): it
        counts as a passthrough writer until `leave`, so every further open of the file is
        passthrough too, and what it writes is watched and taken over as theirs is."""
        cf.pt.opens += 1
        cf.pt.writers += 1
        self.writing.add(cf)
        assert cf.fid is not None
        self._blocks.setdefault(cf, os.stat(self.cachefiles.path(cf.fid)).st_blocks * 512)
        await self._recorded(cf)

    def _may_start(self, cf: CachedFile, writable: bool, daemon_opens: int) -> bool:
        if daemon_opens or cf.symlink is not None or cf.unlinked or cf.fid is None:
            return False
        if not self.reader.holds(cf, 0, cf.size):
            return False
        # a writer the daemon does not see must find room: otherwise the daemon path waits
        if not writable:
            return True
        if cf.spills or short_of_room(self.book.budget):  # the daemon must see each write
            return False  # of a file whose parts spill, or may (D30)
        if self.book.dirty_bytes >= self.book.max_dirty:
            return False
        if self._gated() is None:  # nothing holds it once the kernel writes: room for
            # --max-dirty free now, or the daemon path (which evicts and waits)
            return self.room.free_above_reserve() >= self.book.max_dirty + self.parts.part_size
        return self.room.disk_room(set()) >= self.parts.part_size  # (evicted at the open)

    async def _recorded(self, cf: CachedFile) -> None:
        """The journal knows that the kernel may write the file, before the open is
        answered; a second writer waits for the first one's record."""
        if cf.pt.recorded is not None:
            await cf.pt.recorded.wait()
            return
        cf.pt.recorded = recorded = trio.Event()
        try:
            cf.pt.seen = self._stat(cf)
            if not cf.pt.flagged:  # (a file created in passthrough: flagged at its create)
                await self.writer.save_attrs(cf)  # the journal row, with passthrough = 1
        except BaseException:
            cf.pt.recorded = None
            raise
        finally:
            recorded.set()

    async def leave(self, cf: CachedFile, writable: bool) -> None:
        """A passthrough open was released; the last writer's changes become dirty chunks.
        The open still counts until they have: an open arriving meanwhile joins passthrough
        and reads the cache file, where the chunk map does not yet hold what was written
        (it would have fetched the committed object's old bytes). The take-over runs to
        its end even when the session ends meanwhile (a umount right after the close
        cancels the requests under way): cut, it left the chunk map from before the
        writes, and the exit flush committed that (a file short of its tail in S3)."""
        if not writable:
            cf.pt.opens -= 1
            return
        cf.pt.writers -= 1
        try:
            if cf.pt.writers == 0:
                cf.pt.recorded = None
                self.writing.discard(cf)
                self._blocks.pop(cf, None)
                self._blocks_at_open.pop(cf, None)
                self._unmark(cf)
                try:
                    with trio.CancelScope(shield=True):
                        await self.sync(cf)
                finally:
                    cf.pt.streamed.clear()
                    cf.pt.watched = None
        finally:
            cf.pt.opens -= 1

    async def sync(self, cf: CachedFile) -> None:
        """Bring the chunk map in line with the cache file (before a commit, a truncate,
        and when the last passthrough writer leaves)."""
        async with self._look(cf):
            await self._take_over(cf)

    async def left(self, cf: CachedFile) -> None:
        """Once the last writer has left, return only when its take-over of the chunk
        map is done (before a commit or a truncate). The kernel answers close() before
        the daemon hears of it, so a flush could commit the file in between, with the
        size and chunks from before the writes (a small file went up empty), and return."""
        if self._settling(cf):
            async with self._look(cf):
                pass

    def kernel_writes(self, cf: CachedFile) -> bool:
        """Whether the cache file may hold writes the chunk map does not know yet: while
        the kernel writes it, and until the last writer's take-over is done. The
        attributes come from the cache file meanwhile (`refresh`): else a stat right after
        close(), while the take-over waits for the watcher's hand-over, would get the
        size the watcher saw in the middle of the writes, and the kernel would keep it
        (a torch.save, then a stat, would see a short file)."""
        return cf.pt.writers > 0 or self._settling(cf)

    def _settling(self, cf: CachedFile) -> bool:
        look = self._looking.get(cf)
        return cf.pt.writers == 0 and look is not None and look.locked()

    async def _take_over(self, cf: CachedFile) -> None:
        if self.slow_take_over and cf.pt.writers == 0:
            await trio.sleep(self.slow_take_over)
        if cf.unlinked or cf.fid is None:
            return
        seen = self._stat(cf)
        if seen != cf.pt.seen:
            self._note_written(cf, seen)
            cf.pt.seen = seen
            await self.writer.take_over_written(cf, seen[0], self._parts_to_keep(cf))
        elif cf.pt.writers == 0 and not self.writer.row_covers(cf, cf.size):
            await self.writer.save_attrs(cf)  # unchanged: the journal row loses its flag

    def _parts_to_keep(self, cf: CachedFile) -> frozenset[int]:
        """Streamed chunks that need no new upload now: those waiting for theirs, also
        for a slot (it will read the cache file as it is now), and those whose upload
        began reading or ended before; the commit checks the CRC-32C of these against the
        cache file (`Chunk.verify`) and sends again any that changed. Waiting here for
        uploads in flight would hold back the tail's upload and the commit."""
        keep = set()
        for idx in cf.pt.streamed:
            ch = cf.chunks.get(idx)
            if ch is None or ch.state is ChunkState.CLEAN:
                continue  # committed meanwhile and maybe written again: it goes up
            ch.verify = ch.state is ChunkState.UPLOADED or (
                ch.state is ChunkState.UPLOADING and ch.reading)
            keep.add(idx)
        return frozenset(keep)

    def refresh(self, cf: CachedFile) -> None:
        """Size and mtime as the kernel's writes left them, for the attributes it asks for
        (a stat of a local file: no I/O, cheap enough for the loop)."""
        if cf.fid is not None and not cf.unlinked:
            self._note_written(cf, self._stat(cf))

    @staticmethod
    def _note_written(cf: CachedFile, seen: tuple[int, int]) -> None:
        cf.resized(seen[0])
        if cf.pt.seen is None or seen[1] != cf.pt.seen[1]:  # written since: a new mtime
            cf.touched(max(cf.mtime_ns, seen[1]))

    def size_now(self, cf: CachedFile) -> int:
        """The length of the cache file the kernel writes, as it is now."""
        return self._stat(cf)[0]

    def _stat(self, cf: CachedFile) -> tuple[int, int]:
        assert cf.fid is not None
        st = os.stat(self.cachefiles.path(cf.fid))
        return st.st_size, st.st_mtime_ns


class WritersFirst:
    """Whether streaming waits for the writers, look by look: while they keep every core
    busy and CALM_AFTER seconds after, unless they have been busy for HOLD_AT_MOST."""

    def __init__(self) -> None:
        self._busy_since: float | None = None
        self._held_until = 0.0

    def holds(self, now: float, busy: bool) -> bool:
        if not busy:
            self._busy_since = None
        else:
            if self._busy_since is None:
                self._busy_since = now
            if now - self._busy_since < HOLD_AT_MOST:
                self._held_until = now + CALM_AFTER
        return now < self._held_until


def _written_up_to(path: os.PathLike[str], size: int) -> int:
    """Where the bytes written so far end: the file's size, or its first hole. A writer
    that sets the size first (safetensors' ftruncate) fills the file from the start; the
    chunks past the hole hold zeros nobody wrote yet, and streaming them sent each part
    twice (and S3 refused some: changed while being sent). ext4 answers SEEK_HOLE
    under the inode lock that a write() holds throughout, so blocks reserved for a write
    still copying never count; XFS looks at the page cache there (at most the folio
    being copied, and a chunk goes only with a written byte after it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return size
    try:
        return min(size, os.lseek(fd, 0, os.SEEK_HOLE))
    except OSError:  # (a filesystem without SEEK_HOLE: the size)
        return size
    finally:
        os.close(fd)
