"""Run a command where the native FUSE session cannot start: `python refuse_native.py CMD...`.

A seccomp filter (inherited by every child, the daemon included) answers EACCES to the one
open(2) the native session makes, /dev/fuse with O_RDWR | O_CLOEXEC | O_NONBLOCK, as a
container policy that keeps /dev/fuse from a process could; libfuse opens the device
without O_NONBLOCK, so the pyfuse3 session still mounts. Root only (CAP_SYS_ADMIN installs
a filter without no_new_privs, which would keep fusermount3 from working for others)."""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys

PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
AUDIT_ARCH_X86_64 = 0xC000003E
NR_OPENAT = 257
NATIVE_OPEN_FLAGS = os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK
LD_ABS, JEQ, RET = 0x20, 0x15, 0x06
ALLOW, ERRNO = 0x7FFF0000, 0x00050000


def _filter() -> bytes:
    program = [
        (LD_ABS, 0, 0, 4),  # seccomp_data.arch
        (JEQ, 0, 5, AUDIT_ARCH_X86_64),
        (LD_ABS, 0, 0, 0),  # .nr
        (JEQ, 0, 3, NR_OPENAT),
        (LD_ABS, 0, 0, 32),  # low half of .args[2], the open flags
        (JEQ, 0, 1, NATIVE_OPEN_FLAGS),
        (RET, 0, 0, ERRNO | errno.EACCES),
        (RET, 0, 0, ALLOW),
    ]
    return b"".join(struct.pack("<HBBI", *insn) for insn in program)


def main() -> None:
    code = ctypes.create_string_buffer(_filter())
    prog = struct.pack("<HxxxxxxQ", len(code.raw) // 8, ctypes.addressof(code))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_char_p(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "seccomp filter refused")
    os.execvp(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
