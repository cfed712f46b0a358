"""The CRC-32C of every part of a multipart object the mount wrote, kept in S3 as a small
object of its own that the object's user metadata names (META_PARTS).

S3 keeps a CRC-32C for a whole object and sends it only with a GET of the whole object; a
ranged GET of one part (a chunk the cache fills) comes with nothing to check it against.
The table does: the mount knows each part's CRC when it uploads it, and the metadata that
names the table travels with the object through renames (CopyObject keeps it).

The body is one line of JSON and a line with the CRC-32C of that line, so that a table
changed on the way is never taken for a table saying something else.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from lakefs_mount.s3.crc import crc32c_of
from lakefs_mount.s3.layout import RESERVED_NAME
from lakefs_mount.s3.objectstore import CorruptRead

FORMAT = "lakefs-mount part crc32c 1"
FOLDER = RESERVED_NAME + "/parts/"


def new_table_key(prefix: str) -> str:
    """The key of a new table, under the mount's prefix (random: a table is written once,
    for one upload, before anyone may read the object that names it)."""
    return f"{prefix}{FOLDER}{secrets.token_hex(12)}"


@dataclass(frozen=True)
class PartTable:
    size: int  # the object's
    part_size: int  # the writer's --part-size: which bytes each part holds (PartMap)
    crcs: tuple[int | None, ...]  # part idx+1's CRC-32C; None: not known (copied server-side)

    def crc_of(self, idx: int, size: int, part_size: int) -> int | None:
        """Part idx+1's CRC, for a reader of an object of `size` bytes whose chunks are
        parts of `part_size` (None where the table cannot say)."""
        if size != self.size or part_size != self.part_size or not 0 <= idx < len(self.crcs):
            return None
        return self.crcs[idx]

    def encode(self) -> bytes:
        line = json.dumps({"format": FORMAT, "size": self.size, "part_size": self.part_size,
                           "crc32c": [None if c is None else f"{c:08x}" for c in self.crcs]},
                          separators=(",", ":")).encode()
        return line + b"\n" + f"{crc32c_of(line):08x}\n".encode()

    @classmethod
    def decode(cls, body: bytes, what: str) -> PartTable:
        """The table in `body`; CorruptRead if it is not one whole (changed on the way, or
        not a table at all: the object's metadata names it, so it must be one)."""
        line, _, check = body.partition(b"\n")
        try:
            if check != f"{crc32c_of(line):08x}\n".encode():
                raise ValueError("its own CRC-32C does not match")
            doc = json.loads(line)
            if doc.get("format") != FORMAT:
                raise ValueError(f"not a table of format {FORMAT!r}")
            crcs = tuple(None if c is None else int(c, 16) for c in doc["crc32c"])
            return cls(int(doc["size"]), int(doc["part_size"]), crcs)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptRead(f"{what}: not a whole table of part CRCs ({exc})") from None
