"""The respawn policy and the replica supervisor on a fake clock, with fake processes:
backoff, the reset after a stable minute, what counts as a death. (Real processes:
test_dp_processes.py.)"""

from __future__ import annotations

from multiprocessing.process import BaseProcess

import pytest

from scheduler import ModelLoadError
from scheduler.launch.respawn import (
    BACKOFF,
    BACKOFF_MAX,
    STABLE,
    TRIES,
    ReplicaSupervisor,
    RespawnPolicy,
)


class Clock:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Proc(BaseProcess):
    """A process that exits when the test says so."""

    exitcode: int | None = None
    pid: int | None = None
    _pids = iter(range(10_000, 20_000))

    def __init__(self) -> None:
        self.pid = next(Proc._pids)
        self.exitcode = None
        self.killed = False

    def kill(self) -> None:
        self.killed = True
        if self.exitcode is None:
            self.exitcode = -9

    def join(self, timeout: float | None = None) -> None: ...

    def is_alive(self) -> bool:
        return self.exitcode is None


def test_the_documented_backoff_doubles_up_to_its_ceiling_and_gives_up_after_the_tries(
) -> None:
    clock = Clock()
    policy = RespawnPolicy(1, clock=clock)
    delays = []
    for _ in range(TRIES + 1):
        delays.append(policy.exited(0))
        policy.started(0)
        clock.now += 1.0  # up a second each time: no reset
    # What the README promises: 0.1 s, doubling, at most 5 tries in a row.
    assert (BACKOFF, BACKOFF_MAX, TRIES, STABLE) == (0.1, 5.0, 5, 60.0)
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, None])
    long = RespawnPolicy(1, tries=10, clock=clock)
    assert [long.exited(0) for _ in range(10)][-4:] == [5.0, 5.0, 5.0, 5.0]  # the ceiling


def test_a_replica_up_a_stable_minute_counts_its_tries_from_zero_again() -> None:
    clock = Clock()
    policy = RespawnPolicy(1, clock=clock)
    for _ in range(TRIES):
        assert policy.exited(0) is not None
        policy.started(0)
    clock.now += STABLE - 1.0  # not quite a minute: still the same bout
    assert policy.exited(0) is None
    policy = RespawnPolicy(1, clock=clock)
    for _ in range(TRIES):
        policy.exited(0)
        policy.started(0)
    policy.ready(0)  # its model loaded: it serves from now
    clock.now += STABLE  # a stable minute: the next exit is the first of a new bout
    assert policy.exited(0) == pytest.approx(BACKOFF)
    assert policy.failures(0) == 1


def test_a_replica_that_fails_a_minute_after_its_start_but_never_became_ready_counts_on(
) -> None:
    clock = Clock()
    policy = RespawnPolicy(1, clock=clock)
    for _ in range(TRIES):  # each try takes over a minute to fail to load
        clock.now += STABLE + 1.0
        assert policy.exited(0) is not None
        policy.started(0)
    clock.now += STABLE + 1.0
    assert policy.exited(0) is None  # never ready: given up, not retried for ever
    clock = Clock()
    sup, replicas, starts = _supervisor(clock, ready=lambda i, ranks: False)
    for _ in range(TRIES + 1):  # the same through the supervisor, which never saw it ready
        sup.look()
        clock.now += STABLE + 1.0
        _die(replicas, 0, 1)
        sup.look()
        clock.now += BACKOFF_MAX
        sup.look()
    assert sup.given_up == {0} and len(starts) == TRIES


def test_a_replica_whose_model_does_not_load_gives_every_replica_up_at_once() -> None:
    clock = Clock()
    told: list[str] = []
    bad = ModelLoadError("/m/config.json", "RuntimeError: size mismatch for w")
    failed: list[BaseProcess] = []
    sup, replicas, starts = _supervisor(
        clock, 2, none_left=told.append,
        load_failure=lambda proc: bad if proc in failed else None)
    failed.append(replicas[1][0])
    _die(replicas, 1, 1)
    sup.look()
    clock.now += BACKOFF_MAX
    sup.look()
    assert starts == [] and sup.given_up == {0, 1} and sup.load_error is bad
    assert told == [f"no replica can serve: {bad}"]
    assert told[0] == "no replica can serve: model /m/config.json: RuntimeError: size " \
                      "mismatch for w"


def _supervisor(clock: Clock, n: int = 1, **kwargs: object
                ) -> tuple[ReplicaSupervisor, list[list[BaseProcess]], list[int]]:
    replicas: list[list[BaseProcess]] = [[Proc()] for _ in range(n)]
    starts: list[int] = []

    def start(i: int, attempt: int) -> list[BaseProcess]:
        starts.append(i)
        return [Proc()]

    sup = ReplicaSupervisor(replicas, start, policy=RespawnPolicy(n, clock=clock),
                            **kwargs)  # type: ignore[arg-type]
    return sup, replicas, starts


def _die(replicas: list[list[BaseProcess]], i: int, code: int = -9) -> None:
    proc = replicas[i][0]
    assert isinstance(proc, Proc)
    proc.exitcode = code


def test_the_supervisor_waits_out_the_backoff_on_its_clock_and_resets_after_a_minute(
) -> None:
    clock = Clock()
    told: list[str] = []
    sup, replicas, starts = _supervisor(clock, 2, none_left=told.append)
    for n in range(TRIES):
        _die(replicas, 0)
        sup.look()  # seen dead: due after the backoff
        wait = min(BACKOFF_MAX, BACKOFF * 2 ** n)
        clock.now += wait * 0.9
        sup.look()
        assert starts == [0] * n, "restarted before its backoff ran out"
        clock.now += wait * 0.2
        sup.look()
        assert starts == [0] * (n + 1)
    sup.look()  # seen ready (its model loaded)
    clock.now += STABLE  # stable a minute: the next death is a first try again
    _die(replicas, 0)
    sup.look()
    clock.now += BACKOFF * 1.1
    sup.look()
    assert starts == [0] * (TRIES + 1) and sup.given_up == set()
    for _ in range(TRIES + 1):  # five more deaths in a row, then given up
        _die(replicas, 0)
        sup.look()
        clock.now += BACKOFF_MAX
        sup.look()
    assert sup.given_up == {0} and told == []  # replica1 still serves
    for _ in range(TRIES + 1):
        _die(replicas, 1, 1)
        sup.look()
        clock.now += BACKOFF_MAX
        sup.look()
    assert sup.given_up == {0, 1}
    assert len(told) == 1 and "no replica can serve" in told[0] and "\n" not in told[0]
    assert "replica1 exit code 1" in told[0]


def test_an_exit_0_without_a_shutdown_is_a_death_and_with_one_a_stop() -> None:
    clock = Clock()
    stopped: set[int] = set()
    sup, replicas, starts = _supervisor(clock, 2, shut_down=lambda i, ranks: i in stopped)
    _die(replicas, 0, 0)  # exit 0, but no shutdown reached it
    sup.look()
    clock.now += BACKOFF * 1.1
    sup.look()
    assert starts == [0] and sup.restarts == [1, 0]
    stopped.add(1)
    _die(replicas, 1, 0)
    sup.look()
    clock.now += BACKOFF_MAX
    sup.look()
    assert starts == [0] and sup.stopped == {1} and sup.given_up == set()


def test_a_restart_that_cannot_start_is_a_failed_try_said_as_such() -> None:
    # Without this: a restart whose start raised was recorded as "exit code -1", and the
    # line that gives up on every replica said "replica0 exit code -1".
    clock = Clock()
    told: list[str] = []
    replicas: list[list[BaseProcess]] = [[Proc()]]

    def start(i: int, attempt: int) -> list[BaseProcess]:
        raise OSError("no room for another process")

    sup = ReplicaSupervisor(replicas, start, policy=RespawnPolicy(1, clock=clock),
                            none_left=told.append)
    _die(replicas, 0)
    for _ in range(TRIES + 1):
        sup.look()
        clock.now += BACKOFF_MAX
    sup.look()
    assert sup.given_up == {0}
    assert told == [f"no replica can serve: each exited {TRIES + 1} times in a row (replica0 "
                    "could not be restarted (OSError: no room for another process); the log "
                    "above has their errors)"]
