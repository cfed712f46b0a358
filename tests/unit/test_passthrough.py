"""When the passthrough watcher's streaming waits for the writers (`WritersFirst`): the
rule alone, look by look, with times given; mount/test_passthrough proves it through a mount."""

from __future__ import annotations

from lakefs_mount.cache.passthrough import CALM_AFTER, HOLD_AT_MOST, WritersFirst


def looks(first: WritersFirst, start: float, end: float, busy: bool) -> list[bool]:
    """What `holds` answers at every 0.1 s look from start (inclusive) to end."""
    steps = round((end - start) / 0.1)
    return [first.holds(start + i * 0.1, busy) for i in range(steps)]


def test_streaming_goes_on_while_the_cores_are_not_all_busy():
    assert looks(WritersFirst(), 0.0, 10.0, busy=False) == [False] * 100


def test_busy_writers_hold_streaming_until_the_cores_have_been_calm_a_while():
    first = WritersFirst()
    assert all(looks(first, 0.0, 2.0, busy=True))
    calm = looks(first, 2.0, 3.0, busy=False)
    waited = calm.index(False) * 0.1
    assert CALM_AFTER - 0.15 < waited < CALM_AFTER + 0.15
    assert not any(calm[calm.index(False):])


def test_writers_busy_for_longer_than_the_hold_stream_all_the_same():
    first = WritersFirst()
    busy = looks(first, 0.0, HOLD_AT_MOST + 2.0, busy=True)
    assert all(busy[:int(HOLD_AT_MOST * 10)])
    assert not any(busy[int((HOLD_AT_MOST + CALM_AFTER) * 10) + 1:])


def test_after_a_calm_spell_busy_writers_are_held_again_for_a_whole_hold():
    first = WritersFirst()
    looks(first, 0.0, HOLD_AT_MOST + 2.0, busy=True)  # past the hold: streaming
    looks(first, HOLD_AT_MOST + 2.0, HOLD_AT_MOST + 3.0, busy=False)
    assert all(looks(first, HOLD_AT_MOST + 3.0, 2 * HOLD_AT_MOST + 2.5, busy=True))
