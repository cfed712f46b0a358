"""Raw addresses for Python buffers that the kernel reads or fills asynchronously.

The kernel keeps using an address after io_uring_enter returns, so the memory must stay
valid and unmoved until the CQE arrives, even if the awaiting task is cancelled. A `Pin`
holds a buffer export (PyObject_GetBuffer), which both keeps the object alive and stops
a bytearray from being resized; it is released only when its last user lets go.
"""

from __future__ import annotations

import ctypes

_api = ctypes.pythonapi


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_void_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_api.PyObject_GetBuffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_api.PyObject_GetBuffer.restype = ctypes.c_int
_api.PyBuffer_Release.argtypes = [ctypes.POINTER(_PyBuffer)]
_api.PyBuffer_Release.restype = None
_api.PyBytes_FromStringAndSize.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
_api.PyBytes_FromStringAndSize.restype = ctypes.py_object
_api.PyBytes_AsString.argtypes = [ctypes.py_object]
_api.PyBytes_AsString.restype = ctypes.c_void_p

PYBUF_SIMPLE = 0


class Pin:
    """A contiguous buffer export shared by the caller and its in-flight requests."""

    __slots__ = ("_view", "address", "size", "_users")

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        view = _PyBuffer()
        try:
            _api.PyObject_GetBuffer(data, ctypes.byref(view), PYBUF_SIMPLE)
        except BufferError:  # non-contiguous memoryview: one copy is unavoidable
            _api.PyObject_GetBuffer(bytes(data), ctypes.byref(view), PYBUF_SIMPLE)
        self._view = view
        self.address: int = view.buf or 0
        self.size: int = view.len
        self._users = 1

    def acquire(self) -> Pin:
        """Add a user (an in-flight request) that must finish before the export ends."""
        self._users += 1
        return self

    def release(self) -> None:
        """Drop a user; the last one ends the export."""
        self._users -= 1
        if self._users == 0:
            _api.PyBuffer_Release(ctypes.byref(self._view))


def new_bytes(size: int) -> tuple[bytes, int]:
    """A fresh, not yet shared bytes object and the address of its payload.

    Filling it before anyone else sees it is what os.pread does internally; it saves the
    bytearray-to-bytes copy of every read.
    """
    obj = _api.PyBytes_FromStringAndSize(None, size)
    return obj, _api.PyBytes_AsString(obj)
