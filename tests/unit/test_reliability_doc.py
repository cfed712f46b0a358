"""docs/reliability.md is rewritten by every test run from the rows it carries."""

from __future__ import annotations

from pathlib import Path

from tests.reliability import Row, read_rows, stamp, update


def _row(test: str, scenario: str, lost: int = 0) -> Row:
    return stamp(Row(scenario=scenario, injects="x", acknowledged=3, lost=lost, corrupt=0,
                     seconds=1.5, test=test))


def test_a_run_replaces_the_rows_of_the_tests_it_ran_and_keeps_the_others(
        tmp_path: Path) -> None:
    doc = tmp_path / "reliability.md"
    update(doc, [_row("t.py::a", "A"), _row("t.py::b", "B1"), _row("t.py::b", "B2")],
           {"t.py::a", "t.py::b"})
    update(doc, [_row("t.py::a", "A", lost=1)], {"t.py::a", "t.py::b"})
    rows = read_rows(doc)
    assert [(r.scenario, r.lost) for r in rows] == [("A", 1)]  # b ran and measured nothing
    update(doc, [_row("u.py::c", "C | piped"), _row("tests/faults/test_x.py::d", "D -->")],
           {"u.py::c", "tests/faults/test_x.py::d"})
    text = doc.read_text()
    assert [r.scenario for r in read_rows(doc)] == ["D -->", "A", "C | piped"]  # t9 first
    assert "| A | x | 3 | 1 | 0 | 1.5 | — |  | `t.py::a` |" in text
    assert "C \\| piped" in text  # a cell cannot break the table
