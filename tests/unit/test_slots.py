"""Upload slots (cache/slots.py): the background in arrival order, a waiting flush first,
and express slots that a flush may take only while the background holds the others."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
import trio.testing

from lakefs_mount.cache.slots import Slots


async def _within_seconds(test: Callable[[], Awaitable[None]]) -> None:
    with trio.fail_after(10):
        await test()


async def _holders(slots: Slots, nursery: trio.Nursery, owners: list[tuple[str, bool]],
                   got: list[str], release: dict[str, trio.Event]) -> None:
    """Start a holder per (owner, urgent), one after the other; each records when it
    gets its slot and keeps it until its release event is set."""
    for owner, urgent in owners:
        release[owner] = trio.Event()

        async def hold(owner: str = owner, urgent: bool = urgent) -> None:
            async with slots.hold(owner, urgent):
                got.append(owner)
                await release[owner].wait()

        nursery.start_soon(hold)
        await trio.testing.wait_all_tasks_blocked()


def test_background_holders_get_slots_in_arrival_order() -> None:
    trio.run(_within_seconds, _background_holders_get_slots_in_arrival_order)


async def _background_holders_get_slots_in_arrival_order() -> None:
    slots = Slots(2, 1)
    got: list[str] = []
    release: dict[str, trio.Event] = {}
    async with trio.open_nursery() as nursery:
        await _holders(slots, nursery, [("a", False), ("b", False), ("c", False),
                                        ("d", False)], got, release)
        assert got == ["a", "b"] and slots.waiting == 2
        release["b"].set()
        await trio.testing.wait_all_tasks_blocked()
        assert got == ["a", "b", "c"]
        for event in release.values():
            event.set()
    assert got == ["a", "b", "c", "d"]


def test_an_urgent_holder_overtakes_the_background_and_takes_an_express_slot() -> None:
    trio.run(_within_seconds, _an_urgent_holder_overtakes_the_background_and_takes_an_express_slot)


async def _an_urgent_holder_overtakes_the_background_and_takes_an_express_slot() -> None:
    slots = Slots(2, 1)
    got: list[str] = []
    release: dict[str, trio.Event] = {}
    async with trio.open_nursery() as nursery:
        await _holders(slots, nursery, [("bg1", False), ("bg2", False), ("bg3", False),
                                        ("flush1", True), ("flush2", True)], got, release)
        # Both slots held by the background: the first urgent one goes express at once.
        assert got == ["bg1", "bg2", "flush1"]
        release["bg1"].set()
        await trio.testing.wait_all_tasks_blocked()
        assert got == ["bg1", "bg2", "flush1", "flush2"]  # ahead of bg3, which came first
        release["flush2"].set()
        await trio.testing.wait_all_tasks_blocked()
        assert got[-1] == "bg3"
        for event in release.values():
            event.set()


def test_urgent_holders_alone_keep_to_the_capacity() -> None:
    trio.run(_within_seconds, _urgent_holders_alone_keep_to_the_capacity)


async def _urgent_holders_alone_keep_to_the_capacity() -> None:
    """A flush of everything (unmount) uses the ordinary slots only: express slots exist
    to get past the background, not to exceed --upload-concurrency."""
    slots = Slots(2, 1)
    got: list[str] = []
    release: dict[str, trio.Event] = {}
    async with trio.open_nursery() as nursery:
        await _holders(slots, nursery, [("u1", True), ("u2", True), ("u3", True)], got,
                       release)
        assert got == ["u1", "u2"] and slots.waiting == 1
        for event in release.values():
            event.set()
    assert got == ["u1", "u2", "u3"]


def test_a_waiter_made_urgent_later_moves_ahead() -> None:
    trio.run(_within_seconds, _a_waiter_made_urgent_later_moves_ahead)


async def _a_waiter_made_urgent_later_moves_ahead() -> None:
    slots = Slots(1, 1)
    got: list[str] = []
    release: dict[str, trio.Event] = {}
    async with trio.open_nursery() as nursery:
        await _holders(slots, nursery, [("held", False), ("early", False), ("late", False)],
                       got, release)
        assert got == ["held"]
        slots.prioritize(lambda owner: owner == "late")  # a flush began to wait for it
        await trio.testing.wait_all_tasks_blocked()
        assert got == ["held", "late"]  # in the express slot: "held" is the background
        for event in release.values():
            event.set()
    assert got == ["held", "late", "early"]


def test_a_cancelled_waiter_leaves_the_queue_and_a_cancelled_grant_passes_on() -> None:
    trio.run(_within_seconds, _a_cancelled_waiter_leaves_the_queue_and_a_cancelled_grant_passes_on)


async def _a_cancelled_waiter_leaves_the_queue_and_a_cancelled_grant_passes_on() -> None:
    slots = Slots(1, 0)
    got: list[str] = []

    async def wait_for_slot(owner: str, scope: trio.CancelScope) -> None:
        with scope:
            async with slots.hold(owner):
                got.append(owner)

    async with trio.open_nursery() as nursery:
        gives_up, granted_as_cancelled, last = (trio.CancelScope() for _ in range(3))
        async with slots.hold("first"):
            nursery.start_soon(wait_for_slot, "gives up", gives_up)
            nursery.start_soon(wait_for_slot, "granted as cancelled", granted_as_cancelled)
            nursery.start_soon(wait_for_slot, "last", last)
            await trio.testing.wait_all_tasks_blocked()
            assert slots.waiting == 3
            gives_up.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert slots.waiting == 2
            granted_as_cancelled.cancel()  # and the slot is handed to it right after:
        # (leaving `hold` released "first"'s slot in the same step)
    assert got == ["last"] and slots.waiting == 0
