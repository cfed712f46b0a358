"""The mount's configuration: the hidden test hooks parse strictly."""

from __future__ import annotations

import pytest

from lakefs_mount.config import HooksForTests


def test_test_hooks_are_off_unless_named_and_take_their_field_types():
    assert HooksForTests.parse([]) == HooksForTests()
    hooks = HooksForTests.parse(["cores=1", "slow_take_over=2.5", "hold_move_after_copy=1"])
    assert (hooks.cores, hooks.slow_take_over, hooks.hold_move_after_copy) == (1, 2.5, True)


@pytest.mark.parametrize("item", ["speed=3", "cores=many", "cores"])
def test_an_unknown_or_malformed_test_hook_is_refused(item):
    with pytest.raises(ValueError):
        HooksForTests.parse([item])
