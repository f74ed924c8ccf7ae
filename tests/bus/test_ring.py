from __future__ import annotations

import select
import threading
import time

import pytest

from bus import ChannelClosed, EndOfChannel, Ring, WouldBlock, open_ring


def _readable(ring: Ring[int]) -> bool:
    return bool(select.select([ring.fileno()], [], [], 0)[0])


def test_fd_readable_exactly_when_items_wait() -> None:
    with Ring[int](8) as ring:
        assert not _readable(ring)
        ring.put(1)
        assert _readable(ring)
        ring.put(2)
        assert ring.get_nowait() == 1 and _readable(ring)
        assert ring.drain(10) == [2]
        assert not _readable(ring)


def test_signals_only_on_empty_to_non_empty() -> None:
    with open_ring(int, 1000) as ring:
        for i in range(500):
            ring.put_nowait(i)
        assert ring.statistics().signals == 1
        assert ring.drain(1000) == list(range(500))
        ring.put_nowait(1)
        stats = ring.statistics()
        assert stats.signals == 2 and stats.puts == 501 and stats.gets == 500
        assert stats.high_water == 500


def test_full_ring_nowait_and_timeout() -> None:
    with Ring[int](2, name="egress") as ring:
        ring.put(1)
        ring.put(2)
        with pytest.raises(WouldBlock, match="egress"):
            ring.put_nowait(3)
        with pytest.raises(WouldBlock):
            ring.put(3, timeout=0.01)
        assert ring.statistics().full_events == 2


def test_blocked_producer_resumes_when_consumer_drains() -> None:
    with Ring[int](1) as ring:
        ring.put(0)
        done = threading.Event()

        def produce() -> None:
            ring.put(1, timeout=10)
            done.set()

        t = threading.Thread(target=produce)
        t.start()
        assert not done.wait(0.05)
        assert ring.drain(5) == [0]
        t.join(10)
        assert done.is_set() and ring.drain(5) == [1]


def test_close_wakes_blocked_producer_and_delivers_what_was_queued() -> None:
    ring: Ring[int] = Ring(1)
    ring.put(7)
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            ring.put(8)
        except ChannelClosed as exc:
            errors.append(exc)

    t = threading.Thread(target=produce)
    t.start()
    deadline = time.monotonic() + 5
    while ring.statistics().full_events == 0 and time.monotonic() < deadline:
        time.sleep(0.001)  # sleep-ok: deadline poll for the producer to block
    ring.close()
    ring.close()  # idempotent
    t.join(10)
    assert errors and isinstance(errors[0], ChannelClosed)
    assert _readable(ring)  # the parked consumer wakes
    assert ring.drain(5) == [7]  # nothing lost
    with pytest.raises(EndOfChannel):
        ring.drain(5)
    with pytest.raises(EndOfChannel):
        ring.get_nowait()
    with pytest.raises(ChannelClosed):
        ring.put_nowait(9)
    ring.release()


def test_many_producers_keep_their_own_order() -> None:
    with Ring[tuple[int, int]](64) as ring:
        n = 2000

        def produce(p: int) -> None:
            for i in range(n):
                ring.put((p, i))

        threads = [threading.Thread(target=produce, args=(p,)) for p in range(4)]
        for t in threads:
            t.start()
        got: list[tuple[int, int]] = []
        deadline = time.monotonic() + 20
        while len(got) < 4 * n and time.monotonic() < deadline:
            select.select([ring.fileno()], [], [], 0.1)
            got.extend(ring.drain(100))
        for t in threads:
            t.join()
        for p in range(4):
            assert [i for q, i in got if q == p] == list(range(n))


def test_put_many_takes_what_fits_in_order_with_one_wake_up() -> None:
    ring: Ring[int] = Ring(5)
    assert ring.put_many_nowait([1, 2, 3]) == 3
    assert ring.put_many_nowait([4, 5, 6, 7]) == 2  # room for two
    assert ring.statistics().signals == 1  # empty -> non-empty once
    assert ring.drain(10) == [1, 2, 3, 4, 5]
    ring.close()
    with pytest.raises(ChannelClosed):
        ring.put_many_nowait([8])
    ring.release()
