"""An engine used in a child made by ``os.fork``: every call fails at once, both faces."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import select
import signal
import time
from collections.abc import Callable, Mapping
from typing import Literal

import pytest

from messages import SamplingParams
from scheduler import AsyncEngine, Engine, EngineForked, ModelConfig
from tests.scheduler.test_parity import _public

SMALL = ModelConfig(vocab_size=128, hidden=32, layers=1, seed=3)
LONG = SamplingParams(max_new_tokens=100_000)

#: Every public method of both faces, with arguments that would work in the parent
#: (``start`` is the asyncio face's own). A new method must be added here.
CALLS: dict[str, tuple[object, ...]] = {
    "submit": ([1], LONG), "submit_many": ([[1], [2]], LONG), "generate": ([1], LONG),
    "stream": ([1], LONG), "stream_steps": ([1], LONG), "embed": ([1],),
    "abort": ("nothing",), "collective_rpc": ("get_load",), "metrics": (), "close": (),
    "start": (), "gone": (),
}


def _methods(face: type[object]) -> set[str]:
    return {name for name, sig in _public(face).items() if sig is not None} | {"gone"}


def _report(fd: int, outcomes: dict[str, str]) -> None:
    os.write(fd, json.dumps(outcomes).encode())
    os.close(fd)


def _outcome(exc: BaseException | None) -> str:
    return "no error" if exc is None else f"{type(exc).__name__}: {exc}"


def _in_child(run: Callable[[int], None]) -> tuple[int, dict[str, str]]:
    """Fork; the child runs ``run(fd)``, which reports on ``fd``, and exits. Returns its
    pid and report, or fails if the child has not written it within the deadline (a hang)."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        try:
            run(wfd)
        finally:
            os._exit(0)
    os.close(wfd)
    try:
        got, deadline = b"", time.monotonic() + 30
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"the forked child hung (got {got!r})")
            if select.select([rfd], [], [], left)[0]:
                chunk = os.read(rfd, 65536)
                if not chunk:
                    break
                got += chunk
    finally:
        os.close(rfd)
        os.waitpid(pid, 0)
    outcomes: dict[str, str] = json.loads(got)
    return pid, outcomes


def _each_fails_at_once(child: tuple[int, dict[str, str]], names: set[str]) -> None:
    pid, outcomes = child
    assert set(outcomes) == names
    parent = os.getpid()
    wrong = {name: what for name, what in outcomes.items()
             if not what.startswith(f"{EngineForked.__name__}: ")
             or f"process {parent}; a forked child (pid {pid})" not in what}
    assert not wrong, wrong


def _parent_still_works(load: Mapping[str, object] | None, pending: int) -> None:
    assert load is not None and load["running"] == 0 and load["queued"] == 0, load
    assert pending == 0


@pytest.mark.parametrize("mode", ["ring", "zmq"])
def test_every_engine_call_in_a_forked_child_fails_at_once(mode: Literal["ring", "zmq"]
                                                            ) -> None:
    names = _methods(Engine)
    assert names <= set(CALLS), f"add {sorted(names - set(CALLS))} to CALLS"
    with Engine(mode, SMALL) as engine:
        engine.generate([1, 2], SamplingParams(max_new_tokens=2), timeout=30)

        def run(fd: int) -> None:
            outcomes: dict[str, str] = {}
            for name in sorted(names):
                error: BaseException | None = None
                try:
                    attr = getattr(engine, name)  # (``gone`` is a property: read here)
                    if callable(attr):
                        out = attr(*CALLS[name])
                        if hasattr(out, "__next__"):
                            next(out)
                except BaseException as exc:
                    error = exc
                outcomes[name] = _outcome(error)
            _report(fd, outcomes)

        _each_fails_at_once(_in_child(run), names)
        r = engine.generate([1, 2], SamplingParams(max_new_tokens=2), timeout=30)
        assert r.finish_reason == "length"
        _parent_still_works(engine.collective_rpc("get_load").result, engine.pending)


def test_every_async_engine_call_in_a_forked_child_fails_at_once() -> None:
    names = _methods(AsyncEngine) | {"start"}
    assert names <= set(CALLS), f"add {sorted(names - set(CALLS))} to CALLS"

    async def main() -> tuple[int, dict[str, str]]:
        async with AsyncEngine("ring", SMALL) as engine:
            await engine.generate([1, 2], SamplingParams(max_new_tokens=2), timeout=30)

            async def drive() -> dict[str, str]:
                outcomes: dict[str, str] = {}
                for name in sorted(names):
                    error: BaseException | None = None
                    try:
                        attr = getattr(engine, name)
                        if callable(attr):
                            out = attr(*CALLS[name])
                            if inspect.isawaitable(out):
                                await out
                            elif hasattr(out, "__anext__"):
                                await anext(out)
                    except BaseException as exc:
                        error = exc
                    outcomes[name] = _outcome(error)
                return outcomes

            def run(fd: int) -> None:
                # The child goes on in this coroutine, on the loop it inherited: each
                # call must fail before it waits on anything of the loop's.
                coro = drive()
                try:
                    coro.send(None)
                except StopIteration as done:
                    _report(fd, done.value)

            outcomes = _in_child(run)
            r = await engine.generate([1, 2], SamplingParams(max_new_tokens=2), timeout=30)
            assert r.finish_reason == "length"
            _parent_still_works((await engine.collective_rpc("get_load")).result,
                                engine.pending)
            return outcomes

    _each_fails_at_once(asyncio.run(main()), names)
