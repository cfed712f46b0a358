"""A minimal io_uring ring over raw syscalls, mmap and ctypes.

Why not the `liburing` wheel: its 2026.3.x build is compiled for AVX-512 (`Ring()` zeroes
its struct with `vmovups %zmm0`) and kills the process with SIGILL on CPUs without
AVX-512, which is uncatchable. The ring protocol needed here (setup, mmap, fill SQEs,
enter, drain CQEs, register an eventfd) is small and fully specified by the kernel ABI.

Only x86-64 is supported: its total store order makes the plain 32-bit loads and stores
below sufficient for the acquire/release ordering the ring protocol needs.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct

SYS_IO_URING_SETUP = 425
SYS_IO_URING_ENTER = 426
SYS_IO_URING_REGISTER = 427

IORING_SETUP_CLAMP = 1 << 4
IORING_ENTER_GETEVENTS = 1 << 0
IORING_REGISTER_EVENTFD = 4
IORING_FSYNC_DATASYNC = 1 << 0
IOSQE_ASYNC = 1 << 4

IORING_OFF_SQ_RING = 0
IORING_OFF_CQ_RING = 0x8000000
IORING_OFF_SQES = 0x10000000

OP_NOP = 0
OP_FSYNC = 3
OP_ASYNC_CANCEL = 14
OP_FALLOCATE = 17
OP_READ = 22
OP_WRITE = 23

# io_uring_sqe: opcode, flags, ioprio, fd, off, addr, len, op_flags, user_data,
# buf_index, personality, splice_fd_in, addr3, pad.
_SQE = struct.Struct("<BBHiQQIIQHHiQQ")
_CQE = struct.Struct("<QiI")
_PARAMS = struct.Struct("<7I3I" + "7IIQ" + "8IQ")
assert _SQE.size == 64 and _CQE.size == 16 and _PARAMS.size == 120

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def _check(ret: int) -> int:
    """Turn a -1 libc return into the OSError that errno describes."""
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


class RawRing:
    """One io_uring instance: SQ/CQ rings and SQE array mapped into this process."""

    def __init__(self, entries: int) -> None:
        if platform.machine() not in ("x86_64", "AMD64"):
            raise OSError(errno.ENOSYS, f"io_uring ring not supported on {platform.machine()}")
        params = ctypes.create_string_buffer(_PARAMS.size)
        struct.pack_into("<3I", params, 0, 0, 0, IORING_SETUP_CLAMP)
        self.fd = _check(
            _syscall(ctypes.c_long(SYS_IO_URING_SETUP), ctypes.c_long(entries), params)
        )
        self._maps: list[mmap.mmap] = []
        try:
            self._map(params.raw)
        except BaseException:
            self.close()
            raise

    def _map(self, raw: bytes) -> None:
        """Map the rings the kernel just created and take views on their indices."""
        p = _PARAMS.unpack(raw)
        self.sq_entries, self.cq_entries = p[0], p[1]
        sq_head, sq_tail, sq_mask, _, _, _, sq_array = p[10:17]
        cq_head, cq_tail, cq_mask, _, _, cqes = p[19:25]
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)

        def mapped(size: int, offset: int) -> mmap.mmap:
            m = mmap.mmap(self.fd, size, flags=flags, prot=prot, offset=offset)
            self._maps.append(m)
            return m

        self._sq = mapped(sq_array + self.sq_entries * 4, IORING_OFF_SQ_RING)
        self._cq = mapped(cqes + self.cq_entries * _CQE.size, IORING_OFF_CQ_RING)
        self._sqes = mapped(self.sq_entries * _SQE.size, IORING_OFF_SQES)
        u32 = ctypes.c_uint32
        self._sq_head = u32.from_buffer(self._sq, sq_head)
        self._sq_tail = u32.from_buffer(self._sq, sq_tail)
        self._sq_mask = u32.from_buffer(self._sq, sq_mask).value
        self._sq_array = sq_array
        self._cq_head = u32.from_buffer(self._cq, cq_head)
        self._cq_tail = u32.from_buffer(self._cq, cq_tail)
        self._cq_mask = u32.from_buffer(self._cq, cq_mask).value
        self._cqes = cqes
        self._tail = self._sq_tail.value

    def sq_space(self) -> int:
        """Free SQ slots: entries minus those written but not yet consumed by the kernel."""
        return self.sq_entries - ((self._tail - self._sq_head.value) & 0xFFFFFFFF)

    def put(
        self,
        opcode: int,
        fd: int,
        off: int,
        addr: int,
        length: int,
        op_flags: int,
        user_data: int,
        sqe_flags: int = 0,
    ) -> None:
        """Write one SQE into the next free slot (caller checked sq_space)."""
        idx = self._tail & self._sq_mask
        _SQE.pack_into(
            self._sqes, idx * _SQE.size,
            opcode, sqe_flags, 0, fd, off, addr, length, op_flags, user_data, 0, 0, 0, 0, 0,
        )
        struct.pack_into("<I", self._sq, self._sq_array + idx * 4, idx)
        self._tail = (self._tail + 1) & 0xFFFFFFFF

    def submit(self, wait: int = 0) -> int:
        """Publish the written SQEs and io_uring_enter once; return how many were consumed."""
        self._sq_tail.value = self._tail  # release: SQE stores precede this on x86-64
        pending = self.unsubmitted_to_kernel()
        flags = IORING_ENTER_GETEVENTS if wait else 0
        while True:
            ret = _syscall(
                ctypes.c_long(SYS_IO_URING_ENTER), ctypes.c_long(self.fd),
                ctypes.c_long(pending), ctypes.c_long(wait), ctypes.c_long(flags),
                None, ctypes.c_long(0),
            )
            if ret >= 0:
                return ret
            err = ctypes.get_errno()
            if err != errno.EINTR:
                raise OSError(err, os.strerror(err))

    def unsubmitted_to_kernel(self) -> int:
        """SQEs published in the SQ tail that the kernel has not consumed (head lags)."""
        return (self._sq_tail.value - self._sq_head.value) & 0xFFFFFFFF

    def completions(self) -> list[tuple[int, int]]:
        """Drain every ready CQE as (user_data, res) and hand the slots back."""
        head = self._cq_head.value
        tail = self._cq_tail.value  # acquire: CQE loads below follow this on x86-64
        out = []
        while head != tail:
            user_data, res, _ = _CQE.unpack_from(
                self._cq, self._cqes + (head & self._cq_mask) * _CQE.size
            )
            out.append((user_data, res))
            head = (head + 1) & 0xFFFFFFFF
        self._cq_head.value = head
        return out

    def register_eventfd(self, efd: int) -> None:
        """Have the kernel signal `efd` whenever a CQE is posted."""
        arg = ctypes.c_int32(efd)
        _check(
            _syscall(
                ctypes.c_long(SYS_IO_URING_REGISTER), ctypes.c_long(self.fd),
                ctypes.c_long(IORING_REGISTER_EVENTFD), ctypes.byref(arg), ctypes.c_long(1),
            )
        )

    def close(self) -> None:
        """Unmap and close; the kernel tears down whatever is still queued."""
        for name in ("_sq_head", "_sq_tail", "_cq_head", "_cq_tail"):
            self.__dict__.pop(name, None)  # ctypes views pin the mmaps' exports
        for m in self._maps:
            m.close()
        self._maps.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
