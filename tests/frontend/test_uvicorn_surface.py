"""Every uvicorn name the front door relies on beyond uvicorn's documented API exists on the
installed uvicorn.

``frontend/serving.py`` subclasses uvicorn's HTTP protocol classes (their parser
callbacks, keep-alive timer and request cycle) and ``frontend/listening.py`` and
``frontend/running.py`` subclass and drive ``uvicorn.Server`` (its ``startup``, its state).
None of that is uvicorn's public surface, so ``pyproject.toml`` pins uvicorn to the range
tested; this test names what a new uvicorn removed or renamed, and the file that needs it,
before the door breaks at run time.
"""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

#: uvicorn's HTTP protocols (``--http``) as ``uvicorn.config.HTTP_PROTOCOLS`` names them.
PROTOCOLS = ["h11", "httptools"]
#: What frontend/serving.py uses on each protocol: methods it overrides or calls, and
#: attributes it reads or sets.
PROTOCOL_NAMES = ["connection_made", "connection_lost", "data_received", "pause_writing",
                  "resume_writing", "on_response_complete", "send_400_response", "eof_received",
                  "timeout_keep_alive_handler", "timeout_keep_alive_task",
                  "timeout_keep_alive", "loop", "cycle", "transport", "app"]
#: httptools' parser callbacks it overrides, and what they read (httptools protocol only).
HTTPTOOLS_NAMES = ["on_message_begin", "on_headers_complete", "on_body",
                   "on_message_complete", "url", "headers", "pipeline"]
#: What it reads to tell h11's protocol, and the h11 connection it replaces (h11 only).
H11_NAMES = ["handle_events", "conn"]
#: What frontend/serving.py uses on a protocol's request cycle.
CYCLE_NAMES = ["send", "scope", "response_started", "response_complete", "disconnected",
               "message_event", "keep_alive", "more_body"]
#: ... and on httptools' cycle alone (an HTTP/1.0 answer's framing: h11 frames it itself;
#: a whole answer's one write, ``_send_whole``; a stream's pieces, ``_send_piece``).
HTTPTOOLS_CYCLE_NAMES = ["chunked_encoding", "expected_content_length", "flow",
                         "default_headers", "waiting_for_100_continue", "on_response",
                         "transport"]
#: What frontend/serving.py's ``_send_whole`` and ``_send_piece`` use on uvicorn's flow control.
FLOW_NAMES = ["write_paused", "drain"]
#: What frontend/listening.py and frontend/running.py use on uvicorn.Server.
SERVER_NAMES = ["startup", "shutdown", "serve", "handle_exit", "config", "started",
                "should_exit", "server_state", "lifespan"]


def _has(cls: type, name: str) -> bool:
    """``name`` is defined on ``cls`` (or a base), or assigned as ``self.name`` in it."""
    if hasattr(cls, name):
        return True
    for klass in inspect.getmro(cls):
        if klass is object:
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(name)}\s*(:[^=]*)?=(?!=)", source):
            return True
    return False


def _missing(cls: type, names: list[str], user: str) -> list[str]:
    import uvicorn

    return [f"uvicorn {uvicorn.__version__}: {cls.__module__}.{cls.__qualname__} has no "
            f"{name!r}, which {user} relies on" for name in names if not _has(cls, name)]


def _protocol(name: str) -> type:
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    assert name in HTTP_PROTOCOLS, (
        f"uvicorn.config.HTTP_PROTOCOLS has no {name!r} (frontend/serving.py http_protocol)")
    if name == "httptools":
        pytest.importorskip("httptools")
    cls: type = import_from_string(HTTP_PROTOCOLS[name])
    return cls


def test_the_module_level_names_exist() -> None:
    for module, name, user in [("uvicorn.config", "HTTP_PROTOCOLS", "frontend/serving.py"),
                               ("uvicorn.importer", "import_from_string",
                                "frontend/serving.py"),
                               ("uvicorn", "Server", "frontend/listening.py"),
                               ("uvicorn.server", "ServerState", "frontend/listening.py")]:
        assert hasattr(importlib.import_module(module), name), \
            f"{module} has no {name!r}, which {user} relies on"


@pytest.mark.parametrize("name", PROTOCOLS)
def test_the_protocol_names_exist(name: str) -> None:
    cls = _protocol(name)
    names = PROTOCOL_NAMES + (HTTPTOOLS_NAMES if name == "httptools" else H11_NAMES)
    missing = _missing(cls, names, "frontend/serving.py")
    cycle = getattr(importlib.import_module(cls.__module__), "RequestResponseCycle", None)
    if cycle is None:
        missing.append(f"{cls.__module__} has no 'RequestResponseCycle', whose attributes "
                       "frontend/serving.py relies on")
    else:
        missing += _missing(cycle, CYCLE_NAMES + (HTTPTOOLS_CYCLE_NAMES if name == "httptools"
                                                  else []), "frontend/serving.py")
    assert not missing, "\n".join(missing)


def test_the_flow_control_names_exist() -> None:
    from uvicorn.protocols.http.flow_control import FlowControl

    missing = _missing(FlowControl, FLOW_NAMES, "frontend/serving.py")
    assert not missing, "\n".join(missing)


def test_the_server_names_exist() -> None:
    import uvicorn
    from uvicorn.server import ServerState

    missing = _missing(uvicorn.Server, SERVER_NAMES, "frontend/listening.py")
    missing += _missing(ServerState, ["connections"], "frontend/listening.py")
    missing += _missing(uvicorn.Config, ["backlog", "http_protocol_class"],
                        "frontend/listening.py")
    for method in ("startup", "shutdown"):
        params = inspect.signature(getattr(uvicorn.Server, method)).parameters
        if "sockets" not in params:
            missing.append(f"uvicorn.Server.{method} takes no 'sockets', which "
                           "frontend/listening.py passes")
    lifespan = importlib.import_module("uvicorn.lifespan.on").LifespanOn
    missing += _missing(lifespan, ["shutdown", "state"], "frontend/listening.py")
    assert not missing, "\n".join(missing)


def test_a_missing_name_is_named_with_the_file_that_needs_it() -> None:
    """The check itself: a name uvicorn does not have is reported, not passed over."""
    import uvicorn

    got = _missing(uvicorn.Server, ["no_such_thing"], "frontend/listening.py")
    assert got and "'no_such_thing'" in got[0] and "frontend/listening.py" in got[0]
