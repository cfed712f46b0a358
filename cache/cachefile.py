"""In-memory state of one file in the cache: its chunks and what is committed in S3."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import trio


class ChunkState(enum.Enum):
    """Life of a chunk; a chunk missing from `CachedFile.chunks` is ABSENT (not cached).

    CLEAN     cached bytes equal the committed object (or a hole past its end)
    DIRTY     cached bytes are in no part yet (journal: 'dirty')
    UPLOADING an UploadPart of it is in flight (journal still: 'dirty')
    UPLOADED  part idx+1 of the open upload holds it (journal: 'uploaded', etag)
    """

    CLEAN = "clean"
    DIRTY = "dirty"
    UPLOADING = "uploading"
    UPLOADED = "uploaded"


PENDING_STATES = (ChunkState.DIRTY, ChunkState.UPLOADING, ChunkState.UPLOADED)
DIRTY_STATES = (ChunkState.DIRTY, ChunkState.UPLOADING)  # bytes only the cache holds


@dataclass(frozen=True, slots=True)
class SpilledPart:
    """A full chunk's bytes as an object of their own while the file is open (D30,
    cache/spills): where it is not cached, it is read from there."""

    token: str  # names its object, one per spill: a chunk spilled again gets a new one
    etag: str
    length: int
    crc: int | None


@dataclass
class Chunk:
    state: ChunkState
    gen: int = 0  # bumped by every write; an upload counts only if gen did not move
    etag: str | None = None
    length: int = 0  # bytes the uploaded part holds
    held: int = 0  # bytes of the file in this chunk, as counted by the budgets
    settled: trio.Event | None = None  # set when an UPLOADING chunk leaves that state
    direct: bool = False  # its bytes (most of them) went to disk with O_DIRECT: read
    # them back that way (correct either way: Linux keeps the two paths coherent)
    sent_crc: int | None = None  # CRC-32C of what its UPLOADED part holds, where known
    verify: bool = False  # a passthrough writer may have changed it after its upload began:
    # the commit checks the part's CRC against the cache file before using it
    reading: bool = False  # its upload holds a slot: it reads (or read) the cache file;
    # before that, an UPLOADING part still waits and will read the bytes as they are then
    dirty_since: float | None = None  # trio time it became dirty (ChunkBook); None: clean


@dataclass(slots=True)
class PassthroughState:
    """FUSE passthrough (owned by cache.passthrough): opens the kernel serves from the
    cache file itself, those of them that may write, and the cache file's (size,
    mtime_ns) when the chunk map last matched it."""

    opens: int = 0
    writers: int = 0
    seen: tuple[int, int] | None = None
    recorded: trio.Event | None = None  # set once the journal knows of the writers
    streamed: set[int] = field(default_factory=set)  # chunks handed to the flusher early
    watched: tuple[int, int] | None = None  # (size, mtime_ns) the watcher saw last
    # the journal row certainly carries passthrough = 1 (cleared before anything that may
    # write it without: a row write, a commit that may drop the row)
    flagged: bool = False


@dataclass(slots=True)
class Descriptors:
    """The cache file's descriptors (owned by FdTable), kept open between I/Os."""

    fd: int | None = None
    dfd: int | None = None  # the same file opened with O_DIRECT (see cache.direct)
    busy: int = 0  # engine requests in flight on fd: it may not be closed meanwhile


@dataclass(slots=True)
class UploadErrors:
    """How the file's way into S3 fails (owned by the flusher; status and flushes read)."""

    streak: int = 0  # failures since the last success
    count: int = 0  # failures ever (a flush counts only those after it started)
    last: str | None = None
    last_at: float = 0.0  # monotonic time of `last`: a flush shows only newer ones

    def note(self, message: str) -> None:
        """Why the file's way into S3 failed last (status, and a flush waiting for it)."""
        self.last, self.last_at = message, time.monotonic()

    def failed(self, message: str | None = None) -> None:
        """One more failure: a flush that sees it fail ERRORS_BEFORE_FLUSH_FAILS times in
        a row gives up (the daemon goes on)."""
        self.streak += 1
        self.count += 1
        if message is not None:
            self.note(message)

    def succeeded(self) -> None:
        self.streak = 0
        self.last = None


@dataclass(slots=True)
class Fetches:
    """Reads from S3 (owned by the Fetcher and the Reader)."""

    under_way: dict[int, trio.Event] = field(default_factory=dict)  # chunk -> its GET's end
    read_next: int = -1  # where a sequential reader reads next (readahead trigger)


@dataclass(slots=True)
class Writes:
    """Writes through the daemon (owned by the Writer)."""

    intents: dict[int, trio.Event] = field(default_factory=dict)  # chunk -> intent journalled
    in_flight: int = 0  # write() calls under way: see the Writer's failed-write rule


@dataclass(slots=True)
class CommittedBase:
    """The object in S3 that the file's clean bytes come from (its last commit, or the
    object a listing found)."""

    key: str | None = None
    size: int = 0
    etag: str | None = None
    crc: tuple[str, int] | None = None  # (ETag, CRC-32C) of its last commit
    meta: dict[str, str] | None = None  # its user metadata, when known
    validated_at: float = 0.0  # monotonic time S3 last confirmed `etag`


@dataclass(slots=True)
class OpenUpload:
    """The file's multipart upload under way, if any (owned by cache.uploads)."""

    id: str | None = None
    key: str | None = None
    checksum: bool = False  # its Complete needs every part's CRC-32C
    table: str | None = None  # the key its object's metadata names for its part CRCs
    # A rename kept the open upload at its old key (`key`): the move of the object to the
    # file's key waits for this, set once the upload is completed there (and the file's
    # base is that key) or has left the file uncompleted (nothing to move).
    moves: trio.Event | None = None


@dataclass(eq=False)
class CachedFile:
    """One regular file (or symlink, or special file) with cached or pending content."""

    key: str
    size: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    atime_ns: int | None = None  # set explicitly (utimensat); None: reads as mtime
    ctime_ns: int = 0  # when its content or attributes last changed; 0: not known (mtime)
    fid: int | None = None  # journal id; also names the cache file
    base: CommittedBase = field(default_factory=CommittedBase)
    upload: OpenUpload = field(default_factory=OpenUpload)
    symlink: str | None = None
    rdev: int = 0  # device number of a character or block device
    chunks: dict[int, Chunk] = field(default_factory=dict)
    spills: dict[int, SpilledPart] = field(default_factory=dict)  # clean or not cached
    stale_spills: list[tuple[int, SpilledPart]] = field(default_factory=list)  # to delete
    in_journal: bool = False
    # A commit of it may have put an object at its key that the journal does not know of:
    # a request placing it got no answer here (timed out, connection lost), or the file was
    # recovered from the journal of a daemon that died (an unlink or a rename then deletes
    # that key too, and latewrites watches it).
    commit_unknown: bool = False
    intent_gen: int = 0  # intents issued to the journal (see journal.files.intent_gen)
    version: int = 0  # bumped by every change of content, size or attributes
    committed_version: int = -1
    # the smallest size the file has had since its commit under way started: a commit
    # that lands after a truncate below its size brings a base whose bytes past this are
    # no longer the file's (Writer.zeros_past_cut)
    low_water: int = 0
    writers: int = 0  # open handles that may write
    openers: int = 0
    unlinked: bool = False
    _locks: tuple[trio.Lock, trio.Lock] | None = field(default=None, repr=False)
    page_cache_etag: str | None = None  # version the kernel's page cache holds
    # the key of an object its next commit is to replace (a rename put it, not yet in
    # S3, over a committed file), and that object's table of part CRCs if it named one:
    # the table goes once that commit lands; the object, if the file leaves the key
    # first (unlinked, renamed away), or it would show again there
    replaces: str | None = None
    replaced_table: str | None = None
    # the parts' own state of the file, each written by its owner only
    pt: PassthroughState = field(default_factory=PassthroughState)
    io: Descriptors = field(default_factory=Descriptors)
    errors: UploadErrors = field(default_factory=UploadErrors)
    fetches: Fetches = field(default_factory=Fetches)
    writes: Writes = field(default_factory=Writes)

    # The locks come into being on first use: a fresh mount lists directories of tens of
    # thousands of files, and two trio.Locks per file would take a large share of the
    # listing's CPU.
    @property
    def commit_lock(self) -> trio.Lock:
        """Held while the file is committed (or renamed, removed) in S3."""
        if self._locks is None:
            self._locks = trio.Lock(), trio.Lock()
        return self._locks[0]

    @property
    def upload_lock(self) -> trio.Lock:
        """Held while the file's multipart upload is being created."""
        if self._locks is None:
            self._locks = trio.Lock(), trio.Lock()
        return self._locks[1]

    def late_commit_tag(self, under_way: bool = False) -> str | None:
        """The arg of a DELETE of the file's own key where a commit of it may land there
        unrecorded (its outcome unknown, or one `under_way`): the fid, whose tag the
        mount then watches that key for (latewrites); None once every commit was
        answered."""
        if (self.commit_unknown or under_way) and self.fid is not None:
            return str(self.fid)
        return None

    @property
    def pending(self) -> bool:
        """True while something of this file is not committed in S3."""
        return self.in_journal

    def start_upload(self, upload_id: str, key: str, checksum: bool,
                     table: str | None = None) -> None:
        """The multipart upload its parts go to from now on (created for `key`, naming
        `table` for its part CRCs)."""
        self.upload.id, self.upload.key, self.upload.checksum = upload_id, key, checksum
        self.upload.table = table

    def take_upload(self, completed: bool = False) -> tuple[str, str] | None:
        """Off the file: the open upload's (key, id), once it is completed, aborted, gone,
        or left behind by a rename; None if there is none. An upload that leaves
        uncompleted lets a move waiting for it go (it finds nothing to move); a completed
        one, only once its object is the file's base (`release_move`)."""
        if self.upload.id is None or self.upload.key is None:
            return None
        taken = self.upload.key, self.upload.id
        self.upload.id = self.upload.key = self.upload.table = None
        self.upload.checksum = False
        if not completed:
            self.release_move()
        return taken

    def release_move(self) -> None:
        if self.upload.moves is not None:
            self.upload.moves.set()
            self.upload.moves = None

    def commit_key(self) -> str:
        """Where the next commit puts the object: the file's key, or the old key of an
        upload a rename kept (its object moves to the file's key afterwards)."""
        if self.upload.moves is not None and self.upload.key is not None:
            return self.upload.key
        return self.key

    def object_seen(self, key: str | None, size: int, etag: str | None, now: float) -> None:
        """S3 holds the file as this object and nothing of it is pending: the file is the
        object (its size), confirmed `now` (close-to-open)."""
        assert not self.pending, self.key
        self.size = self.base.size = size
        self.base.key, self.base.etag = key, etag
        self.base.validated_at = now

    def row_written(self) -> None:
        """The journal holds the file's row from now on: it is pending."""
        self.in_journal = True

    def discarded(self, unlinked: bool = True) -> None:
        """Nothing of it goes to S3 any more (its journal row is gone with its pending
        changes); `unlinked`: nor does its name (else only those changes were dropped)."""
        self.in_journal = False
        self.pt.flagged = False
        self.unlinked = unlinked

    def row_dropped(self) -> None:
        """The journal holds no row of the file any more: nothing of it is pending, or
        nothing of it will go to S3 (unlinked)."""
        assert self.unlinked or not any(
            c.state in PENDING_STATES for c in self.chunks.values()), self.key
        self.in_journal = False
        self.pt.flagged = False

    def flag_doubtful(self) -> None:
        """A commit may drop the journal row, passthrough flag and all: the flag is not
        certain until a row write sets it again (the generation moves on, so that one
        already under way does not)."""
        self.pt.flagged = False
        self.intent_gen += 1

    def commit_answer_lost(self) -> None:
        self.commit_unknown = True

    def committed(self, key: str, size: int, etag: str, crc: int | None,
                  meta: dict[str, str]) -> None:
        """A commit placed the file's content in S3 as the object `key` (with CRC-32C
        `crc` where known, and user metadata `meta`): its new base."""
        self.base.key, self.base.size, self.base.etag = key, size, etag
        self.base.crc = None if crc is None else (etag, crc)
        self.base.meta = meta
        self.base.validated_at = time.monotonic()

    def rebased(self, key: str | None, etag: str | None = None) -> None:
        """Its base object is now `key` (a rename; a move in S3, which may have given it
        the ETag `etag`)."""
        self.base.key = key
        if etag is not None:
            self.base.etag = etag
            self.base.validated_at = time.monotonic()

    def changed(self) -> None:
        """Its content, size or attributes changed: a commit of an older version no
        longer leaves it clean."""
        self.version += 1

    def resized(self, size: int) -> None:
        self.size = size

    def validated(self, at: float) -> None:
        """S3 confirmed its base at monotonic time `at` (close-to-open)."""
        self.base.validated_at = max(self.base.validated_at, at)

    def page_cache_stale(self) -> None:
        """The kernel's page cache of it may no longer hold what the cache file holds."""
        self.page_cache_etag = None

    def touched(self, mtime_ns: int | None = None) -> None:
        """Its content or size changed: at `mtime_ns` (default: now)."""
        self.mtime_ns = time.time_ns() if mtime_ns is None else mtime_ns
        self.ctime_ns = max(self.ctime_ns, self.mtime_ns)

    def set_attrs(self, mode: int | None = None, uid: int | None = None,
                  gid: int | None = None, mtime_ns: int | None = None,
                  atime_ns: int | None = None, ctime_ns: int | None = None) -> None:
        """Attributes set through the mount (chmod, chown, utimens; the caller says when:
        `ctime_ns`) or read from S3; None keeps one."""
        if atime_ns is not None:
            self.atime_ns = atime_ns
        if ctime_ns is not None:
            self.ctime_ns = ctime_ns
        if mode is not None:
            self.mode = mode
        if uid is not None:
            self.uid = uid
        if gid is not None:
            self.gid = gid
        if mtime_ns is not None:
            self.mtime_ns = mtime_ns

    def state(self, idx: int) -> ChunkState | None:
        ch = self.chunks.get(idx)
        return None if ch is None else ch.state

    def all_direct(self, indices: Iterable[int]) -> bool:
        """True if these chunks are cached, each written with O_DIRECT (mostly)."""
        return all(ch is not None and ch.direct for ch in map(self.chunks.get, indices))

    def dirty_chunk_count(self) -> int:
        return sum(1 for c in self.chunks.values() if c.state in PENDING_STATES)
