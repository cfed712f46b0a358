"""`status --json` says on/off as JSON booleans (each with a `*_reason` when off), never
as the words `on`, `off`, `yes` or `no`; the table still reads `on` / `off (why)`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.mounting import cli

pytestmark = pytest.mark.parametrize("fuse_session", ["native", "pyfuse3"], indirect=True)

WORDS = re.compile(r"(on|off|yes|no|true|false)( \(.*)?", re.IGNORECASE | re.DOTALL)


def _strings(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _strings(item, f"{path}[{i}]")
    elif isinstance(value, str):
        yield path, value


def test_status_json_has_booleans_where_it_said_on_or_off(mount):
    (mount.path / "f").write_bytes(b"x" * 100_000)
    status = json.loads(cli("status", str(mount.path), "--json", check=True).stdout)
    worded = {path: text for path, text in _strings(status) if WORDS.fullmatch(text)}
    assert not worded, worded
    for key in ("passthrough", "splice_writes", "spliced_reads"):
        assert isinstance(status[key], bool), (key, status[key])
    for key in ("passthrough", "spliced_reads"):
        reason = status[f"{key}_reason"]
        assert (reason is None) == status[key] and (reason is None or reason.strip()), status
    table = cli("status", str(mount.path), check=True).stdout
    for key, label in (("passthrough", "passthrough"), ("spliced_reads", "spliced reads")):
        shown = re.search(rf"^{label} +(.*)$", table, re.MULTILINE)
        assert shown, table
        expected = "on" if status[key] else f"off ({status[key + '_reason']})"
        assert shown.group(1) == expected, table
    assert "reason" not in table, table  # the reasons are in the on/off rows, not apart
