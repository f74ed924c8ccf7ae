"""``python -m frontend``'s arguments, without starting a server."""

from __future__ import annotations

import os
import socket
import stat
import tempfile
from pathlib import Path

import pytest

from frontend.__main__ import _check_listen, base_url, main, parse, settings_from
from scheduler import ModelConfig
from scheduler.models.tiny_hf import build_tiny_hf
from tests.frontend.bpe import train_byte_level


def test_defaults_are_loopback_ring_byte_level(tmp_path: Path) -> None:
    args = parse(["--endpoint", str(tmp_path / "ep")])
    assert (args.host, args.port, args.mode) == ("127.0.0.1", 8000, "ring")
    settings, app = settings_from(args)
    assert settings.rpc_endpoint == f"ipc://{tmp_path}/ep/rpc"
    assert settings.run_dir is None  # the operator's directory: never removed
    assert stat.S_IMODE(os.stat(tmp_path / "ep").st_mode) == 0o700
    assert app.tokenizer.name == "byte-level"
    assert isinstance(settings.model, ModelConfig)
    assert settings.model.vocab_size == app.tokenizer.vocab_size == 259
    assert settings.body_timeout == 30.0
    assert settings_from(parse(["--endpoint", str(tmp_path / "ep"), "--body-timeout",
                                "2.5"]))[0].body_timeout == 2.5
    assert (settings.dp_policy, settings.limits.prefix_cache_bytes) == ("least_loaded", 1 << 30)
    aware = settings_from(parse(["--endpoint", str(tmp_path / "ep"), "--mode", "zmq",
                                 "--dp-size", "2", "--dp-policy", "cache_aware",
                                 "--prefix-cache-bytes", "4096"]))[0]
    assert (aware.dp_size, aware.dp_policy, aware.limits.prefix_cache_bytes) == (
        2, "cache_aware", 4096)


def test_served_model_names(tmp_path: Path) -> None:
    # Without this: --model DIR was served as DIR's basename (a client set up for vLLM
    # or SGLang, which serve the path as given, got a 404) and one name only.
    ep = ["--endpoint", str(tmp_path / "ep")]
    settings = settings_from(parse(ep))[0]
    assert (settings.model_name, settings.model_aliases) == ("tiny", ())
    settings = settings_from(parse([*ep, "--served-model-name", "a", "b/c", "a"]))[0]
    assert (settings.model_name, settings.model_aliases) == ("a", ("b/c",))
    build_tiny_hf(tmp_path / "models" / "m")
    given = f"{tmp_path}/models/../models/m/"
    assert settings_from(parse([*ep, "--model", given]))[0].model_name == given
    with pytest.raises(SystemExit, match="--served-model-name"):
        settings_from(parse([*ep, "--served-model-name", "x" * 2000]))


def test_the_start_up_line_names_a_url_a_client_can_use() -> None:
    # An IPv6 host in brackets; port 0 names no port (uvicorn's own line does).
    assert base_url("127.0.0.1", 8000) == "http://127.0.0.1:8000/v1"
    assert base_url("::1", 8000) == "http://[::1]:8000/v1"
    assert ":0/" not in base_url("127.0.0.1", 0) and "free port" in base_url("127.0.0.1", 0)


def test_a_tokenizer_directory_sizes_the_model(tmp_path: Path) -> None:
    directory = train_byte_level(tmp_path / "tok", vocab_size=400)
    settings, app = settings_from(parse(["--tokenizer", str(directory),
                                         "--endpoint", str(tmp_path / "ep")]))
    assert isinstance(settings.model, ModelConfig)
    assert settings.model.vocab_size == app.tokenizer.vocab_size == 400


@pytest.mark.parametrize(("argv", "says"), [
    (["--tp-size", "2"], "need --mode zmq"),
    (["--tokenizer", "/nonexistent/dir"], "no tokenizer.json"),
    (["--curve-keys", "x.key_secret"], "CURVE keys"),
    # (a plaintext rpc door on the network: anyone could call shutdown)
    (["--allow-remote"], "--allow-remote needs --curve-keys"),
    (["--max-queued-requests", "0"], "--max-queued-requests"),
    (["--body-timeout", "0"], "--body-timeout"),
    (["--body-timeout", "nan"], "--body-timeout"),
    (["--header-timeout", "-1"], "--header-timeout"),
    (["--max-header-bytes", "0"], "--max-header-bytes"),
    (["--max-header-bytes", "10"], "at least 1024"),  # (every request was a 431)
    (["--tiny-model", "stub", "--model", "/nonexistent"], "--tiny-model stub"),  # (ignored)
    (["--max-body-bytes", "-1"], "--max-body-bytes"),  # (every request was a 413)
    (["--default-max-tokens", "-5"], "--default-max-tokens"),  # (each client's 400)
    (["--default-max-tokens", "100000000"], "at most 1048576"),
    (["--max-batch", "0"], "--max-batch"),
])
def test_bad_arguments_exit_with_a_reason(tmp_path: Path, argv: list[str], says: str) -> None:
    with pytest.raises(SystemExit) as info:
        settings_from(parse([*argv, "--endpoint", str(tmp_path / "ep")]))
    assert says in str(info.value)


def test_a_chat_template_that_does_not_compile_stops_start_up(tmp_path: Path) -> None:
    # Without this: the engine started (~10 s), then "the engine did not start" and a
    # TemplateSyntaxError traceback; now one line, before anything starts.
    tok = train_byte_level(tmp_path / "tok", chat_template="{% for m in messages %}{{ m }")
    with pytest.raises(SystemExit, match="chat template does not compile"):
        settings_from(parse(["--tokenizer", str(tok), "--endpoint", str(tmp_path / "ep")]))
    assert not (tmp_path / "ep").exists()  # refused before the door's directory is made


def test_an_endpoint_that_cannot_serve_stops_start_up(tmp_path: Path) -> None:
    # Without this: both were found only after the engine had started, with a traceback.
    with pytest.raises(SystemExit, match=r"--endpoint: .* needs a port"):
        settings_from(parse(["--endpoint", "tcp://127.0.0.1:notaport"]))
    with pytest.raises(SystemExit, match=r"--endpoint: .*beyond loopback"):
        settings_from(parse(["--endpoint", "tcp://0.0.0.0:5999"]))
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "[::1]")):
        with socket.socket(family) as other:  # the port is another process's
            other.bind((host.strip("[]"), 0))
            other.listen()
            port = other.getsockname()[1]
            with pytest.raises(SystemExit, match=r"--endpoint: .*another process listens"):
                settings_from(parse(["--endpoint", f"tcp://{host}:{port}"]))
    # An IPv6 loopback door binds (zmq refuses an IPv6 literal unless told).
    with socket.socket(socket.AF_INET6) as free:
        free.bind(("::1", 0))
        door = f"tcp://[::1]:{free.getsockname()[1]}"
    settings, _ = settings_from(parse(["--endpoint", door]))
    assert settings.rpc_endpoint == door
    # A directory too deep for a Unix socket's path was "another live process".
    with pytest.raises(SystemExit, match=r"--endpoint: .*more than the 107"):
        settings_from(parse(["--endpoint", str(tmp_path / ("d" * 120))]))
    assert not (tmp_path / ("d" * 120)).exists()
    taken = tmp_path / "taken"
    taken.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as other:  # another server's live door
        other.bind(str(taken / "rpc"))
        other.listen()
        with pytest.raises(SystemExit, match=r"--endpoint: .*another live process"):
            settings_from(parse(["--endpoint", str(taken)]))


def test_a_shared_endpoint_directory_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(SystemExit, match="writable"):
        settings_from(parse(["--endpoint", str(shared)]))


def test_an_http_port_in_use_stops_start_up_before_the_engine(tmp_path: Path) -> None:
    # Without this: uvicorn binds only after the engine has started (a model load),
    # then exited with an error; now one line, before anything starts.
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port}"):
            main(["--port", str(port), "--endpoint", str(tmp_path / "ep")])


def test_start_up_refuses_what_would_fail_later(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # Without the start-up checks, each of these got past them and failed once
    # the engine had started, or did something else than the operator asked.
    # (called by main before settings_from, so before any directory is made)
    with pytest.raises(SystemExit, match="--port must be 0-65535, not 70000"):  # (was 4464)
        _check_listen("127.0.0.1", 70000)
    with socket.socket() as other:  # localhost names 127.0.0.1 (and maybe ::1): each tried
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(SystemExit, match=r"cannot listen .*\(127\.0\.0\.1\)"):
            _check_listen("localhost", other.getsockname()[1])
    for door, says in (("tcp://127.0.0.1:0", "needs a fixed port"),
                       ("tcp://127.0.0.1:*", "needs a fixed port"),
                       ("tcp://127.0.0.1:8000", r"other than the HTTP server's \(--port 8000\)")):
        with pytest.raises(SystemExit, match=says):
            settings_from(parse(["--endpoint", door]))
    monkeypatch.chdir(tmp_path)  # a relative directory, short as given, too long absolute
    name = "d" * (107 - len(str(tmp_path)))
    with pytest.raises(SystemExit, match=r"--endpoint: .*more than the 107"):
        settings_from(parse(["--endpoint", name]))
    assert not (tmp_path / name).exists()
    deep = tmp_path / ("t" * 100)  # no --endpoint: the run directory under a deep TMPDIR
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with pytest.raises(SystemExit, match=r"run directory: .*give --endpoint, or a shorter TMPDIR"):
        settings_from(parse([]))
    assert list(deep.iterdir()) == []  # and it is not left behind
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    settings, _ = settings_from(parse([]))  # the frontend's own: removed at its close
    assert settings.run_dir is not None and settings.rpc_endpoint == f"ipc://{settings.run_dir}/rpc"


def test_the_door_is_bound_where_it_was_checked(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # Without this: L/../d, with L a symlink, was made and checked where the
    # kernel resolves it (real/d), but bound where abspath's text points (a 0777 d).
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "L").symlink_to(tmp_path / "real" / "sub")
    (tmp_path / "d").mkdir(mode=0o777)
    (tmp_path / "d").chmod(0o777)
    settings, _ = settings_from(parse(["--endpoint", f"{tmp_path}/L/../d"]))
    assert settings.rpc_endpoint == f"ipc://{tmp_path}/real/d/rpc"
    with pytest.raises(SystemExit, match="other than the HTTP server's"):  # (a leading zero)
        settings_from(parse(["--endpoint", "tcp://127.0.0.1:08000"]))
    monkeypatch.setenv("HOME", str(tmp_path))  # ~ as --model takes it
    settings, _ = settings_from(parse(["--endpoint", "~/home-ep"]))
    assert settings.rpc_endpoint == f"ipc://{tmp_path}/home-ep/rpc"
