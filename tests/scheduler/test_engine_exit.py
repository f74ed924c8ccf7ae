"""An ``Engine`` still open when its script ends: the script exits cleanly (status 0,
nothing on stderr) and promptly, however it left the engine.

Each case is a real script run by a fresh interpreter (ring mode: the scheduler
is a thread of that process). Without the exit close, an engine closed by an
``atexit`` handler, or collected just before the end, failed its close with
``RuntimeError: cannot schedule new futures after interpreter shutdown`` (its
close waited on the default executor, which refuses work once the interpreter
begins to exit); an engine left open with a request running could abort the
process (``terminate called without an active exception``, status 134) as
the embedded scheduler thread was torn down mid-step.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PRELUDE = """\
import atexit
from messages import SamplingParams
from scheduler import Engine, ModelConfig

def make():
    engine = Engine("ring", ModelConfig(vocab_size=64, hidden=32, layers=1, seed=3))
    engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
    return engine
"""

CASES = {
    # atexit.register(engine.close), the usual way to close at exit
    "closed_by_atexit": """
        engine = make()
        atexit.register(engine.close)
        engine.submit([1, 2], SamplingParams(max_new_tokens=100_000))
    """,
    # collected unclosed just before the end: its finalizer's close runs as the
    # interpreter exits
    "dropped_at_the_end": """
        make()
    """,
    # left open, a stream begun and unread, its request running at the end
    "open_with_a_stream": """
        engine = make()
        chunks = iter(engine.stream([1, 2], SamplingParams(max_new_tokens=100_000)))
        next(chunks)
    """,
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_script_ends_cleanly_with_its_engine_left_open(case: str) -> None:
    script = PRELUDE + textwrap.dedent(CASES[case]) + "print('end', flush=True)\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env=env)
    assert (run.returncode, run.stdout, run.stderr) == (0, "end\n", ""), run.stderr[-3000:]


ASYNC_OPEN = """\
import asyncio
from messages import SamplingParams
from scheduler import AsyncEngine, ModelConfig

kept = []

async def main():
    engine = AsyncEngine("ring", ModelConfig(vocab_size=64, hidden=32, layers=1, seed=3))
    await engine.start()
    kept.append(engine)
    steps = engine.stream_steps([1, 2], SamplingParams(max_new_tokens=100_000))
    await anext(steps)
    kept.append(steps)

asyncio.run(main())
print('end', flush=True)
"""


def test_a_script_ends_cleanly_with_an_async_engine_left_open_and_busy() -> None:
    # Without the exit close, the loop ended by asyncio.run left the engine open, its
    # embedded scheduler thread mid-step as the interpreter was torn down: the process
    # aborted (status 134, "terminate called without an active exception").
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", ASYNC_OPEN], capture_output=True, text=True,
                         timeout=120, env=env)
    assert (run.returncode, run.stdout) == (0, "end\n"), run.stderr[-3000:]
    assert "terminate called" not in run.stderr and "Fatal" not in run.stderr, run.stderr
