"""CRC-32C as S3 writes it (`x-amz-checksum-crc32c`), and the CRC of pieces combined in
order: what the uploads declare, the journal keeps, the manifest records and `verify`
compares. It lives with the object store so that every layer above may use it."""

from __future__ import annotations

import base64

import crc32c

# crc(A + B) from crc(A), crc(B) and len(B), as zlib's crc32_combine does for its own
# polynomial: multiply crc(A) by x^(8 len(B)) modulo the (reflected) Castagnoli polynomial.

_POLY = 0x82F63B78


def _multmodp(a: int, b: int) -> int:
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()  # x^(2^n) modulo the polynomial


def _x8nmodp(n: int) -> int:
    """x^(8 n) modulo the polynomial."""
    p, k = 1 << 31, 3  # x^0; 8 = 2^3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC-32C of A followed by B."""
    return _multmodp(_x8nmodp(len_b), crc_a) ^ crc_b


def crc32c_of(data: bytes | memoryview, crc: int = 0) -> int:
    return int(crc32c.crc32c(data, crc))


def encode_crc(crc: int) -> str:
    """As S3 writes x-amz-checksum-crc32c: base64 of the 4 big-endian bytes."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def decode_crc(text: str) -> int | None:
    """x-amz-checksum-crc32c back to the CRC (None if it is not 4 bytes of base64)."""
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        return None
    return int.from_bytes(raw, "big") if len(raw) == 4 else None
