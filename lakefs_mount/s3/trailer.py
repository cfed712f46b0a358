"""A part body sent as `aws-chunked` with its CRC-32C as a trailer.

The checksum header of a request goes before its body, so declaring a part's CRC-32C in
it means reading the part twice: once to hash it, once to send it. A trailer comes
after the body instead (STREAMING-UNSIGNED-PAYLOAD-TRAILER): the CRC is taken as the
pieces go out, and S3 checks it all the same (InvalidDigest/BadDigest if the bytes it
got do not match).
"""

from __future__ import annotations

from collections.abc import Iterator

import crc32c

from lakefs_mount.s3.crc import encode_crc
from lakefs_mount.s3.objectstore import PiecewiseBody

CHUNK = 64 * 1024 * 1024  # bytes of body per aws-chunk (the last one holds the rest): a
# part is one chunk, so the framing costs no more sends than the body's own pieces
TRAILER_NAME = "x-amz-checksum-crc32c"
_TRAILER_BYTES = len(f"0\r\n{TRAILER_NAME}:{encode_crc(0)}\r\n\r\n")


def _framing(n: int) -> int:
    return len(b"%x\r\n" % n) + 2  # size line, then CRLF after the chunk's bytes


class TrailedBody:
    """`body` framed as aws-chunked, its CRC-32C in the trailer. A body that offers
    `sent_crc` (the CRC of the bytes its last complete pass yielded, as `CachePartBody`
    does) is not hashed a second time; `crc` is the trailer's value once sent."""

    def __init__(self, body: PiecewiseBody) -> None:
        self._body = body
        self.decoded = len(body)
        full, rest = divmod(self.decoded, CHUNK)
        self._length = (self.decoded + full * _framing(CHUNK)
                        + (_framing(rest) if rest else 0) + _TRAILER_BYTES)
        self.crc: int | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"content-encoding": "aws-chunked",
                "x-amz-content-sha256": "STREAMING-UNSIGNED-PAYLOAD-TRAILER",
                "x-amz-decoded-content-length": str(self.decoded),
                "x-amz-trailer": TRAILER_NAME}

    def __len__(self) -> int:
        return self._length

    def pieces(self) -> Iterator[memoryview]:
        hashed_inside = hasattr(self._body, "sent_crc")
        crc, left, remaining = 0, 0, self.decoded
        for piece in self._body.pieces():
            while len(piece):
                if not left:
                    if not remaining:
                        raise ValueError("the body is longer than its length")
                    left = min(CHUNK, remaining)
                    yield memoryview(b"%x\r\n" % left)
                take = piece[:left]
                piece = piece[len(take):]
                if not hashed_inside:
                    crc = crc32c.crc32c(take, crc)
                yield take
                left -= len(take)
                remaining -= len(take)
                if not left:
                    yield memoryview(b"\r\n")
        if remaining:
            raise ValueError(f"the body ended {remaining} bytes short of its length")
        if hashed_inside:
            inner: int | None = getattr(self._body, "sent_crc", None)
            if inner is None:
                raise ValueError("the body's pass was not in order: no CRC to send")
            crc = inner
        self.crc = crc
        yield memoryview(f"0\r\n{TRAILER_NAME}:{encode_crc(crc)}\r\n\r\n".encode())
