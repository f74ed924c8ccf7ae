"""The blocking Engine when its caller lets go: a wait interrupted in the caller's thread
(Ctrl-C) cancels the call, so a generate's request is aborted (without it: the request
ran on, holding its slot, to its last token), and so is an interrupted stream's, its
traceback kept (as an interactive session keeps it); an engine collected without a
close is closed, with a ResourceWarning (without it: its loop thread and scheduler ran
for the life of the process)."""

from __future__ import annotations

import contextlib
import gc
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from types import FrameType

import pytest

from messages import SamplingParams
from scheduler import Engine, ModelConfig

SMALL = ModelConfig(vocab_size=128, hidden=32, layers=1, seed=3)
LONG = SamplingParams(max_new_tokens=100_000)
WAIT = 20.0  # seconds a condition that must come is polled for


class Interrupted(BaseException):
    """What the test's SIGINT handler raises (as Python's raises KeyboardInterrupt)."""


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.005)  # sleep-ok: pacing of a deadline poll


def _running(engine: Engine) -> int:
    result = engine.collective_rpc("get_load").result
    assert isinstance(result, dict)
    running = result["running"]
    assert isinstance(running, int)
    return running


@contextlib.contextmanager
def _interrupted_once_running(engine: Engine) -> Iterator[None]:
    """Run the body in the main thread; once ``engine`` runs a request, another thread
    sends the main one SIGINT, whose handler raises :class:`Interrupted` there."""
    main = threading.main_thread().ident
    assert main == threading.get_ident()

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise Interrupted

    def when_running() -> None:
        _until(lambda: _running(engine) == 1, "the request running")
        signal.pthread_kill(main, signal.SIGINT)

    before = signal.signal(signal.SIGINT, interrupt)
    sender = threading.Thread(target=when_running, daemon=True)
    try:
        sender.start()
        yield
    finally:
        sender.join(WAIT)
        signal.signal(signal.SIGINT, before)


def test_an_interrupted_generate_aborts_its_request() -> None:
    with Engine("ring", SMALL) as engine:
        with _interrupted_once_running(engine), pytest.raises(Interrupted):
            engine.generate([1, 2, 3], LONG)
        _until(lambda: _running(engine) == 0, "the interrupted request aborted")
        # (its last answer, the abort's, may still be on its way to the engine)
        _until(lambda: engine.pending == 0, "the aborted request's last answer")
        assert len(engine.generate([1, 2], SamplingParams(max_new_tokens=2)).token_ids) == 2


def test_an_interrupted_stream_aborts_its_request_while_its_traceback_is_kept() -> None:
    with Engine("ring", SMALL) as engine:
        with (_interrupted_once_running(engine),
              pytest.raises(Interrupted) as kept):  # (its traceback holds the stream)
            for _ in engine.stream([1, 2, 3], LONG):
                pass
        _until(lambda: _running(engine) == 0, "the interrupted stream's request aborted")
        assert kept.tb is not None


def test_an_engine_collected_unclosed_is_closed() -> None:
    engine = Engine("ring", SMALL)
    core, thread = engine._core, engine._loop_thread
    assert len(engine.generate([1, 2], SamplingParams(max_new_tokens=2)).token_ids) == 2
    gone = weakref.ref(engine)
    with pytest.warns(ResourceWarning, match="an Engine .* without close"):
        del engine
        gc.collect()
    assert gone() is None, "the engine was not collected"
    thread.join(WAIT)
    assert not thread.is_alive(), "its loop thread still runs"
    assert core.closed
