"""docs/PROTOCOL.md against the code: channels, rpc shapes, error codes, the layout
grammar and the fingerprint recipe (the field tables: tests/messages/test_golden.py)."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import msgspec

from messages import CHANNELS, ErrorCode, catalogue_schema, wire_layout
from messages.rpc_api import RPC_METHODS

DOC = (Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md").read_text()


def _section(title: str) -> str:
    return DOC.split(title, 1)[1].split("\n## ", 1)[0]


def _tags(cell: str) -> list[str]:
    return re.findall(r"`(\w+)`", cell)


def test_channel_table_matches_the_declarations() -> None:
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \| ([^|]+) \|$",
                      _section("## 1. Sockets"), re.M)
    table = {name: {"inbound": _tags(a), "outbound": _tags(b)} for name, a, b in rows}
    assert table == {ch.name: ch.carried_tags() for ch in CHANNELS}


def _type(t: msgspec.inspect.Type) -> str:
    i = msgspec.inspect
    for cls, text in ((i.IntType, "int"), (i.FloatType, "float"), (i.StrType, "str"),
                      (i.BoolType, "bool")):
        if isinstance(t, cls):
            return text
    assert isinstance(t, i.ListType), t
    return f"list[{_type(t.item_type)}]"


def _cell(struct: type[msgspec.Struct]) -> str:
    info = msgspec.inspect.type_info(struct)
    assert isinstance(info, msgspec.inspect.StructType)
    if not info.fields:
        return "(none)"
    return ", ".join(f"`{f.name}` {_type(f.type)}{'' if f.required else '?'}"
                     for f in info.fields)


def test_rpc_table_matches_the_declared_methods() -> None:
    section = _section("## 4. Rpc")
    rows = re.findall(r"^\| `(\w+)` \| .*$", section, re.M)
    assert rows == [spec.name for spec in RPC_METHODS]
    for spec in RPC_METHODS:
        line = f"| `{spec.name}` | {_cell(spec.params)} | {_cell(spec.result)} | {spec.summary} |"
        assert line in section, line


def test_error_code_table_lists_every_code() -> None:
    rows = re.findall(r"^\| `(\w+)` \| ", _section("### `ErrorOut` codes"), re.M)
    assert sorted(rows) == sorted(typing.get_args(ErrorCode))


def test_checks_beyond_the_tables_are_listed() -> None:
    section = _section("### Checks beyond the tables")
    for what in ("`input_ids` is not empty", "vocabulary size", "`dp_rank`", "in flight",
                 "messages/checks.py"):
        assert what in section, what


_MEMBER = (r"(?:int|float|str|bool|null|bin|any|packed_u32|tensor|ndarray(?:\[\w+\])?"
           r"|literal\[[^\]]+\]|[A-Z]\w*)")


def _parses(text: str) -> bool:
    """The type-text grammar of section 8 (lists and maps peeled recursively)."""
    while True:  # innermost list[...] / map[...,...] with no bracket left inside
        new = re.sub(r"list\[(" + _MEMBER + r"(?:\|" + _MEMBER + r")*)\]", "any", text)
        new = re.sub(r"map\[(" + _MEMBER + r"(?:\|" + _MEMBER + r")*),(" + _MEMBER
                     + r"(?:\|" + _MEMBER + r")*)\]", "any", new)
        if new == text:
            break
        text = new
    return re.fullmatch(_MEMBER + r"(?:\|" + _MEMBER + r")*", text) is not None


def test_every_layout_type_text_follows_the_documented_grammar() -> None:
    layout = wire_layout()
    for name, t in layout.items():
        for f in t.fields:
            assert _parses(f.type), f"{name}.{f.name}: {f.type}"
            nested = re.findall(r"\b([A-Z]\w*)\b", f.type)
            assert all(n in layout for n in nested), f.type


def test_the_documented_fingerprint_recipe_gives_the_published_fingerprint() -> None:
    block = _section("## 8. Schema").split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict[str, object] = {}
    exec(block, scope)  # the document's own code, run as a reader would
    doc = catalogue_schema()
    assert scope["fingerprint"](doc) == doc["x-fingerprint"]  # type: ignore[operator]


def test_the_newest_catalogue_change_names_the_published_fingerprint() -> None:
    """A layout change is deliberate: it is listed, with its fingerprint, in section 8."""
    rows = re.findall(r"^\| `([0-9a-f]{16})` \| (.+) \|$", _section("### Catalogue changes"),
                      re.M)
    assert rows, "no catalogue changes listed"
    assert len({fp for fp, _ in rows}) == len(rows)
    assert rows[-1][0] == catalogue_schema()["x-fingerprint"], (
        "the layout changed: add a row to PROTOCOL.md's 'Catalogue changes'")
