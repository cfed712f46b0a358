"""The native FUSE session over /dev/fuse: the only package that knows FUSE's wire format
(as only `uring/` knows io_uring). It drives the same `FileSystem` core as the pyfuse3
adapter and adds what libfuse 3.14 cannot negotiate: kernel passthrough, 1 MiB requests."""

from lakefs_mount.fuse.native.device import DeviceError
from lakefs_mount.fuse.native.ops import KernelOps
from lakefs_mount.fuse.native.session import NativeSession

__all__ = ["DeviceError", "KernelOps", "NativeSession"]
