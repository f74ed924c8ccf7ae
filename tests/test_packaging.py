"""Package-level invariants: exports, typing marker, no pickle anywhere."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["messages", "bus", "router", "scheduler", "frontend"]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_matches_exports(name: str) -> None:
    mod = importlib.import_module(name)
    assert sorted(mod.__all__) == sorted(set(mod.__all__)), "duplicates in __all__"
    for attr in mod.__all__:
        assert hasattr(mod, attr), f"{name}.__all__ names missing {attr}"
    public = {
        k for k, v in vars(mod).items()
        if not k.startswith("_") and not isinstance(v, type(importlib))
    }
    assert public <= set(mod.__all__) | {"annotations"}, public - set(mod.__all__)


@pytest.mark.parametrize("name", PACKAGES)
def test_ships_py_typed(name: str) -> None:
    assert (ROOT / name / "py.typed").is_file()


def _modules() -> list[Path]:
    return [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]


def test_no_pickle_anywhere() -> None:
    banned = {"pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve"}
    for path in _modules():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                names = set()
            assert not names & banned, f"{path} imports {names & banned}"
            if isinstance(node, ast.Attribute):
                assert node.attr not in {"send_pyobj", "recv_pyobj", "loads"} or not (
                    isinstance(node.value, ast.Name) and node.value.id in banned
                ), f"{path}:{node.lineno} uses {node.attr}"
                assert node.attr not in {"send_pyobj", "recv_pyobj"}, (
                    f"{path}:{node.lineno} uses {node.attr}"
                )


def test_messages_imports_no_other_package() -> None:
    for path in (ROOT / "messages").rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                mods = (
                    [a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                for m in mods:
                    assert m.split(".")[0] not in {"zmq", "bus", "router", "scheduler"}, (
                        f"{path} imports {m}"
                    )


def test_every_error_derives_from_the_root() -> None:
    from messages import BusError

    for name in PACKAGES:
        mod = importlib.import_module(name)
        for attr in mod.__all__:
            obj = getattr(mod, attr)
            if isinstance(obj, type) and issubclass(obj, BaseException):
                assert issubclass(obj, BusError), f"{name}.{attr} is not a BusError"
