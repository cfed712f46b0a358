"""Holding back writers the daemon never sees: fanotify's pre-content events.

A passthrough writer's write() goes from the kernel straight into the cache file; no FUSE
request reaches the daemon, so neither --max-dirty nor --cache-size could make it wait.
Linux (6.14 and later) reports a pre-content event (FAN_PRE_ACCESS, with the range) before
each read or write of a file that an fanotify group of class FAN_CLASS_PRE_CONTENT
watches, and the access waits until the group answers it. Whether a file's accesses are
reported at all is fixed when the file is opened: the kernel opens the backing file of a
passthrough open when it gets the OPEN reply, so a cache file is marked (`watch`) before
its writer's open is answered. A mark whose events are also in its ignore mask is quiet:
the kernel drops each event itself, and an access costs no round trip to the daemon; the
ignore mask can be taken off (`speak`) and put back while the open lasts.

A `WriteGate` answers the events in a thread of its own: the daemon's own accesses at
once; everybody else's while the bytes `admit` last allowed last (each access counts its
range), and those past it once `admit` allows more. A dead daemon's group is gone, and
with it every held event (the kernel lets them through): a crash never leaves a writer
stuck.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import select
import struct
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

FAN_CLOEXEC = 0x00000001
FAN_NONBLOCK = 0x00000002
FAN_CLASS_PRE_CONTENT = 0x00000008
FAN_MARK_ADD = 0x00000001
FAN_MARK_REMOVE = 0x00000002
FAN_MARK_IGNORE = 0x00000400
FAN_MARK_IGNORED_SURV_MODIFY = 0x00000040  # else the first write clears the ignore mask
QUIET = FAN_MARK_IGNORE | FAN_MARK_IGNORED_SURV_MODIFY
FAN_PRE_ACCESS = 0x00100000
FAN_ALLOW = 0x01
FAN_EVENT_INFO_TYPE_RANGE = 6
AT_FDCWD = -100
_METADATA = struct.Struct("IBBHQii")  # event_len, vers, reserved, metadata_len, mask, fd, pid
_RESPONSE = struct.Struct("iI")  # fd, response

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
_libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int,
                                ctypes.c_char_p]


class WriteGate:
    """Pre-content events of the marked cache files, answered by a thread (see the
    module's docstring). `open()` fails with OSError where the kernel has none."""

    def __init__(self) -> None:
        self._fd = -1
        self._lock = threading.Lock()
        self._left: int | None = None  # bytes others may still access; None: no bound
        self._held: list[tuple[int, int]] = []  # (event fd, bytes) waiting to be admitted
        self._waker_r, self._waker_w = -1, -1
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self.holds = 0  # accesses that waited (metrics read it)
        self.reported = 0  # accesses of other processes the kernel asked about

    def open(self) -> None:
        fd = _libc.fanotify_init(FAN_CLASS_PRE_CONTENT | FAN_CLOEXEC | FAN_NONBLOCK,
                                 os.O_RDONLY | os.O_CLOEXEC | os.O_LARGEFILE)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"fanotify pre-content events: {os.strerror(err)}")
        self._fd = fd
        self._waker_r, self._waker_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._answer, name="write-gate", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop answering; every event still held goes through."""
        if self._fd < 0:
            return
        self.admit(None)
        os.write(self._waker_w, b"x")
        assert self._thread is not None
        self._thread.join()
        for fd in (self._fd, self._waker_r, self._waker_w):
            os.close(fd)
        self._fd = -1

    def holds_on(self, directory: Path) -> bool:
        """Whether writers of files in `directory` can be held: the file system must
        report pre-content events (ext4, xfs, btrfs do; tmpfs does not: EOPNOTSUPP)."""
        fd, probe = tempfile.mkstemp(prefix=".gate-probe-", dir=directory)
        os.close(fd)
        try:
            self._mark(FAN_MARK_ADD, Path(probe))
            self._mark(FAN_MARK_REMOVE, Path(probe))
        except OSError:
            return False
        finally:
            os.unlink(probe)
        return True

    def watch(self, path: Path, loud: bool) -> None:
        """Mark `path`: every open of it from now on is one whose accesses can be held;
        `loud`: they are reported now (else once `speak`)."""
        if not loud:  # (quiet first: no access slips through loud in between)
            self._mark(FAN_MARK_ADD | QUIET, path)
        self._mark(FAN_MARK_ADD, path)

    def speak(self, path: Path, loud: bool) -> None:
        """Report the accesses of a marked `path` from now on, or drop them in the kernel."""
        self._mark((FAN_MARK_REMOVE if loud else FAN_MARK_ADD) | QUIET, path)

    def unwatch(self, path: Path) -> None:
        """No mark on `path` any more (none there, or `path` gone: nothing to do)."""
        for how in (FAN_MARK_REMOVE, FAN_MARK_REMOVE | QUIET):
            try:
                self._mark(how, path)
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                    raise

    def _mark(self, how: int, path: Path) -> None:
        if _libc.fanotify_mark(self._fd, how, FAN_PRE_ACCESS, AT_FDCWD,
                               os.fsencode(path)) < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(path))

    def admit(self, limit: int | None) -> None:
        """Let other processes access `limit` bytes more of the marked files, then hold
        them (0: hold them now); None: no bound. Held accesses go on while it lasts."""
        with self._lock:
            self._left = limit
            go = []
            while self._held and (self._left is None or self._left > 0):
                efd, count = self._held.pop(0)
                go.append(efd)
                if self._left is not None:
                    self._left -= count
        for efd in go:
            self._allow(efd)

    @property
    def waiting(self) -> int:
        return len(self._held)

    def _answer(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._waker_r, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._waker_r in ready:
                return
            try:
                buf = os.read(self._fd, 8192)
            except BlockingIOError:
                continue
            offset = 0
            while offset + _METADATA.size <= len(buf):
                length, _, _, meta, _, efd, pid = _METADATA.unpack_from(buf, offset)
                count = _range_count(buf[offset + meta:offset + length])
                offset += length
                if efd < 0:
                    continue
                if pid != self._pid:
                    self.reported += 1
                    if self._hold(efd, count):
                        continue
                self._allow(efd)

    def _hold(self, efd: int, count: int) -> bool:
        with self._lock:
            if self._left is None:
                return False
            if self._left > 0 and not self._held:
                self._left -= count
                return False
            self._held.append((efd, count))
            self.holds += 1
            return True

    def _allow(self, efd: int) -> None:
        try:
            os.write(self._fd, _RESPONSE.pack(efd, FAN_ALLOW))
        except OSError as exc:  # (the event is gone: its group closed)
            log.debug("answering a pre-content event: %s", exc)
        finally:
            os.close(efd)


def _range_count(info: bytes) -> int:
    """The byte count of an event's range record (FAN_EVENT_INFO_TYPE_RANGE: type u8,
    pad u8, len u16, pad u32, offset u64, count u64); 0 where the event has none."""
    while len(info) >= 4:
        kind, _, size = struct.unpack_from("BBH", info)
        if kind == FAN_EVENT_INFO_TYPE_RANGE and size >= 24:
            return int(struct.unpack_from("Q", info, 16)[0])
        if size < 4:
            break
        info = info[size:]
    return 0
