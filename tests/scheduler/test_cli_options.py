"""``python -m frontend`` and ``python -m scheduler serve/dispatch`` share their common
options: one name, one default, one help each, the older spellings kept as aliases."""

from __future__ import annotations

import argparse
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

import scheduler.__main__ as scheduler_main
from frontend.__main__ import build_parser as frontend_parser
from scheduler.cli.options import (
    DEPRECATED_ALIASES,
    add_backlog_option,
    add_dp_policy_option,
    add_scheduler_options,
)

#: Options both commands have under one name that mean different things there: the
#: frontend's ``--mode`` also offers ring (the scheduler in its own process), and its
#: ``--endpoint`` is the rpc door alone, ``serve``'s the directory of all three sockets.
DIFFERENT_ON_PURPOSE = {"mode", "endpoint"}
#: Options whose help names the server they secure (``add_curve_options(what=...)``).
HELP_NAMES_ITS_SERVER = {"allow_remote", "curve_keys", "curve_allow"}


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = scheduler_main.build_parser()
    for action in parser._actions:  # argparse keeps its subcommands nowhere public
        if isinstance(action, argparse._SubParsersAction):
            sub: argparse.ArgumentParser = action.choices[name]
            return sub
    raise AssertionError("python -m scheduler has no subcommands")


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's options by destination (positionals and --help left out)."""
    return {a.dest: a for a in parser._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)}


def _definition(action: argparse.Action, *, with_help: bool = True) -> tuple[object, ...]:
    return (sorted(action.option_strings), action.type, action.default, action.choices,
            action.nargs, action.const, action.metavar, action.help if with_help else None)


def _shared(*adders: Callable[[argparse.ArgumentParser], None]) -> dict[str, argparse.Action]:
    p = argparse.ArgumentParser()
    for add in adders:
        add(p)
    return _options(p)


PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "frontend": frontend_parser, "serve": lambda: _subparser("serve"),
    "dispatch": lambda: _subparser("dispatch")}
SHARED = {"frontend": _shared(add_scheduler_options, add_backlog_option),
          "serve": _shared(add_scheduler_options, add_backlog_option),
          "dispatch": _shared(add_dp_policy_option, add_backlog_option)}


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_each_command_has_the_shared_options_as_defined_once(command: str) -> None:
    got = _options(PARSERS[command]())
    for dest, shared in SHARED[command].items():
        assert dest in got, f"{command} lacks the shared option {shared.option_strings}"
        assert _definition(got[dest]) == _definition(shared), (
            f"{command} defines {shared.option_strings} itself, not through "
            "scheduler.cli.options: define it there once")


@pytest.mark.parametrize("other", ["serve", "dispatch"])
def test_an_option_of_both_commands_is_spelled_and_defined_alike(other: str) -> None:
    """Any option both parsers have (by what it sets) has the same names, default and
    choices in both: one defined in one parser alone, or renamed there, fails here."""
    front, sched = _options(frontend_parser()), _options(PARSERS[other]())
    for dest in sorted((set(front) & set(sched)) - DIFFERENT_ON_PURPOSE):
        with_help = dest not in HELP_NAMES_ITS_SERVER
        assert _definition(front[dest], with_help=with_help) == \
            _definition(sched[dest], with_help=with_help), (
                f"--{dest.replace('_', '-')} differs between python -m frontend "
                f"({front[dest].option_strings}) and {other} ({sched[dest].option_strings}): "
                "define it once in scheduler.cli.options")
    by_name = {s: d for d, a in sched.items() for s in a.option_strings}
    for dest, action in front.items():
        for name in action.option_strings:
            assert by_name.get(name, dest) == dest or dest in DIFFERENT_ON_PURPOSE, (
                f"{name} sets {dest!r} in python -m frontend but {by_name[name]!r} in {other}")


SPELLINGS = [(["--dp-size", "3"], ["--dp", "3"]),
             (["--dp-policy", "round_robin"], ["--policy", "round_robin"])]


@pytest.mark.parametrize(("new", "old"), SPELLINGS)
def test_both_spellings_give_the_same_values_in_both_commands(new: list[str],
                                                              old: list[str]) -> None:
    assert DEPRECATED_ALIASES[old[0]] == new[0]
    runs: dict[str, Callable[[list[str]], argparse.Namespace]] = {
        "frontend": lambda a: frontend_parser().parse_args(a),
        "serve": lambda a: scheduler_main.build_parser().parse_args(
                ["serve", "--endpoint", "/nowhere", *a])}
    if new[0] == "--dp-policy":
        runs["dispatch"] = lambda a: scheduler_main.build_parser().parse_args(
            ["dispatch", "--endpoint", "/nowhere", "--replica", "/r", *a])
    dest = new[0].lstrip("-").replace("-", "_")
    values = {(command, spelling[0]): getattr(parse(spelling), dest)
              for command, parse in runs.items() for spelling in (new, old)}
    assert set(values.values()) == {type(values[("frontend", new[0])])(new[1])}, values


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_help_names_the_deprecated_aliases(command: str) -> None:
    text = " ".join(PARSERS[command]().format_help().split())
    for old, new in DEPRECATED_ALIASES.items():
        if new in text:
            assert f"{old}: deprecated alias" in text, f"{command} --help: {old} undocumented"


def _ipv6_loopback() -> bool:
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_serve_metrics_line_names_the_bound_port_of_an_ipv6_host(tmp_path: Path) -> None:
    """``--metrics-port 0 --metrics-host ::1``: the line is a URL a client can open."""
    proc = subprocess.Popen([sys.executable, "-m", "scheduler", "serve", "--endpoint",
                             str(tmp_path / "sched"), "--metrics-port", "0",
                             "--metrics-host", "::1"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for x in proc.stderr or ():
            lines.put(x)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        line = ""
        while not line.startswith("metrics: "):
            assert time.monotonic() < deadline and proc.poll() is None, "no metrics line"
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
        url = line.split(" ", 1)[1].strip()
        assert url.startswith("http://[::1]:") and not url.startswith("http://[::1]:0/"), url
        with urllib.request.urlopen(url, timeout=30) as answer:
            assert answer.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        reader.join(10)
        if proc.stderr is not None:
            proc.stderr.close()


@pytest.mark.parametrize(("flag", "value"), [
    ("--max-queued-requests", "0"), ("--max-queued-tokens", "-3"), ("--max-backlog", "0"),
    ("--prefix-cache-bytes", "-1"), ("--max-handoff-bytes", "0"),
    ("--handoff-deadline", "nan")])
def test_a_limit_out_of_range_is_named_by_its_flag_in_both_commands(
        flag: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Without this: "every limit must be >= 1" (which of three?) or the field's
    # name (prefix_cache_bytes), never the flag the operator typed, nor the value.
    from frontend.__main__ import parse, settings_from
    with pytest.raises(SystemExit) as door:
        settings_from(parse(["--endpoint", str(tmp_path / "door"), flag, value]))
    assert str(door.value).startswith(f"{flag} must be "), door.value
    assert str(door.value).endswith(f"not {float(value) if 'deadline' in flag else value}")
    with pytest.raises(SystemExit) as serve:
        scheduler_main.main(["serve", "--endpoint", str(tmp_path / "serve"), flag, value])
    assert serve.value.code == 2
    assert f"error: {flag} must be " in capsys.readouterr().err


def test_allow_remote_without_curve_is_refused_in_both_commands(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Without this, --allow-remote alone bound a plaintext endpoint beyond loopback:
    # any host that reached its port could call shutdown or save_checkpoint(path=...).
    from frontend.__main__ import parse, settings_from
    with pytest.raises(SystemExit) as door:
        settings_from(parse(["--endpoint", "tcp://0.0.0.0:5611", "--allow-remote"]))
    assert "--allow-remote needs --curve-keys and --curve-allow" in str(door.value)
    with pytest.raises(SystemExit) as serve:
        scheduler_main.main(["serve", "--endpoint", "tcp://0.0.0.0:5612", "--allow-remote"])
    assert serve.value.code == 2
    assert "--allow-remote needs --curve-keys and --curve-allow" in capsys.readouterr().err
