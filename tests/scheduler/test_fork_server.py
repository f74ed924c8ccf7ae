"""Scheduler processes forked from multiprocessing's fork server (``scheduler.launch.processes``),
each through a script of its own (a fork server is per process, and these kill one or fork
the process that holds it):

* a child made by ``os.fork`` after its parent started a ``zmq`` engine starts an engine of
  its own (it inherited the parent's fork server, which is not its child to use);
* a fork server that dies does not take its processes with it: the engine serves on, and
  its close stops them (multiprocessing read the server's death as their exit); one
  that exits after it is said to have an unknown exit code, not 255;
* a scheduler process imports nothing of the starting script (a spawned one imported
  it again, and so ran what its top level does), nor does the fork server (which
  multiprocessing has preload ``__main__`` by default);
* a scheduler process reads its starter's environment as it is when the process starts
  (the fork server's is the one its starter had when the server started).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_FORKED_CHILD = """
import os
from scheduler import Engine, ModelConfig
MODEL = ModelConfig(vocab_size=259, kind="stub")
if __name__ == "__main__":
    engine = Engine("zmq", MODEL)
    pid = os.fork()
    if pid == 0:
        try:
            with Engine("zmq", MODEL) as own:
                print("child", own.generate([1, 2]).finish_reason, flush=True)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    print("parent", engine.generate([1, 2]).finish_reason, flush=True)
    engine.close()
"""

_KILLED_SERVER = """
import os, signal, time
import multiprocessing.forkserver
from scheduler import Engine, ModelConfig
from tests.procs import alive, children
if __name__ == "__main__":
    with Engine("zmq", ModelConfig(vocab_size=259, kind="stub"), dp_size=2) as engine:
        engine.generate([1, 2])
        server = multiprocessing.forkserver._forkserver._forkserver_pid
        forked = children(server)
        assert len(forked) == 3, forked  # the dispatcher and two replicas
        os.kill(server, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while alive(server):
            assert time.monotonic() < deadline
            time.sleep(0.01)  # sleep-ok: pacing a deadline poll
        for _ in range(20):  # the supervisor looks every 50 ms: a second of looks
            assert engine.generate([1, 2]).finish_reason == "length"
            time.sleep(0.05)  # sleep-ok: spacing the requests over the supervisor's looks
        assert engine.gone is None, engine.gone
        assert all(alive(p) for p in forked), forked
        print("served on", flush=True)
    deadline = time.monotonic() + 30
    while any(alive(p) for p in forked):
        assert time.monotonic() < deadline, [p for p in forked if alive(p)]
        time.sleep(0.01)  # sleep-ok: pacing a deadline poll
    print("stopped", flush=True)
    with Engine("zmq", ModelConfig(vocab_size=259, kind="stub")) as engine:
        os.kill(multiprocessing.forkserver._forkserver._forkserver_pid, signal.SIGKILL)
        os.kill(engine.collective_rpc("get_load").result["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while engine.gone is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)  # sleep-ok: pacing a deadline poll
        print(engine.gone, flush=True)
"""

_SCRIPT_AND_ENV = """
import sys
from pathlib import Path
MARK = Path(sys.argv[1])
if __name__ != "__main__":  # (imported in another process: what this test refuses)
    MARK.write_text(__name__)
from scheduler import Engine, ModelConfig
if __name__ == "__main__":
    import multiprocessing.forkserver
    for n in range(2):
        with Engine("zmq", ModelConfig(vocab_size=259, kind="stub"), dp_size=1 + n) as engine:
            print(n, engine.generate([1]).finish_reason, flush=True)
    print(multiprocessing.forkserver._forkserver._preload_modules, flush=True)
"""

_ENV_NOW = """
import os, sys
from pathlib import Path
from scheduler.launch import processes
from tests.procs import write_environ
if __name__ == "__main__":
    ctx = processes._context()
    for n, value in enumerate(["before", "after"]):
        # The fork server starts with the first process, its environment as it is then.
        os.environ["TSB_TEST_NOW"] = value
        out = Path(sys.argv[1]) / str(n)
        proc = ctx.Process(target=processes._child,
                           args=(processes._parent(), write_environ, str(out),
                                 "TSB_TEST_NOW"))
        processes._start(proc)
        proc.join(60)
        print(out.read_text(), flush=True)
"""


def _run(tmp_path: Path, script: str, *args: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(script)
    out = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True,
                         timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_a_forked_child_starts_an_engine_of_its_own(tmp_path: Path) -> None:
    assert _run(tmp_path, _FORKED_CHILD).split("\n")[:2] == ["child length", "parent length"]


def test_a_killed_fork_server_leaves_its_processes_serving_until_the_close(
        tmp_path: Path) -> None:
    out = _run(tmp_path, _KILLED_SERVER).splitlines()
    assert out[:2] == ["served on", "stopped"], out
    assert out[2] == ("scheduler process scheduler exited (exit code unknown: the fork "
                      "server that started it is gone)"), out


def test_a_scheduler_process_imports_nothing_of_the_starting_script(tmp_path: Path) -> None:
    mark = tmp_path / "imported"
    assert _run(tmp_path, _SCRIPT_AND_ENV, str(mark)).splitlines() == [
        "0 length", "1 length", "['scheduler.launch.processes']"]
    assert not mark.exists(), f"the script was imported as {mark.read_text()!r}"


def test_a_scheduler_process_reads_its_starters_environment_as_it_is_now(
        tmp_path: Path) -> None:
    assert _run(tmp_path, _ENV_NOW, str(tmp_path)).splitlines() == ["before", "after"]
