"""``Scheduler.abandon`` through ``Upstream``: the reader of the work inbox's outputs
went away, so its requests are dropped, unanswered, on every rank."""

from __future__ import annotations

from collections.abc import Callable

from bus import Ring
from messages import AbortReq, BatchTokenIDOut, ErrorOut, Output, Request
from scheduler.core.admission import Limits
from scheduler.core.loop import Upstream
from tests.scheduler.rig import Loop, gen


def _rids(outputs: list[Output]) -> set[str]:
    rids: set[str] = set()
    for out in outputs:
        if isinstance(out, BatchTokenIDOut):
            rids |= {rid for rid, _, _ in out.items()}
        elif isinstance(out, ErrorOut):
            rids.add(out.rid)
    return rids


def test_requests_of_a_reader_that_left_are_dropped_on_every_rank_and_answer_no_one(
        make_loop: Callable[..., Loop]) -> None:
    egress: Ring[Output] = Ring(4, name="out")  # a reader that stopped reading, then left
    told: list[Request] = []  # what tensor-parallel followers are told
    left = [False]

    def gone() -> bool:
        was, left[0] = left[0], False
        return was

    loop = make_loop("ring", egress=egress, max_batch=4, limits=Limits(max_backlog=4096),
                     tell_ranks=told.append, upstream=Upstream("work", gone))
    old = [f"old{i}" for i in range(6)]  # 4 running, 2 queued
    for rid in old:
        req = gen(rid, [1, 2], max_new_tokens=100_000, temperature=0.0)
        req.stream = True
        loop.send(req)
    loop.run_until(lambda: loop.sched.statistics().running == 4 and loop.sched.router.backlog > 0)
    left[0] = True
    loop.sched.step()
    stats = loop.sched.statistics()
    assert (stats.running, stats.queued) == (0, 0)
    assert not loop.sched.busy and loop.sched.router.backlog == 0
    assert loop.sched.upstream_aborts == 6 and loop.sched.upstream_dropped > 0
    assert {r.rid for r in told if isinstance(r, AbortReq)} == set(old)
    delivered = egress.drain(64)  # what the old reader had been given already
    assert _rids(delivered) <= set(old)
    # A new reader is served normally, and gets nothing of the old requests.
    loop.send(gen("new", [3, 4], max_new_tokens=5, temperature=0.0))
    seen: list[Output] = []

    def done() -> bool:
        seen.extend(egress.drain(64))
        return any(isinstance(o, BatchTokenIDOut) and ("new", "length") in
                   ((rid, fin) for rid, _, fin in o.items()) for o in seen)

    loop.run_until(done)
    assert _rids(seen) == {"new"}
    load = loop.call("get_load").result or {}
    assert (load["upstream_aborts"], load["upstream_dropped"]) == (6, loop.sched.upstream_dropped)
    egress.release()
