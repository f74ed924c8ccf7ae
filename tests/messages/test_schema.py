"""The published schema, its layout and fingerprint, and ``python -m messages check``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from messages import Message, catalogue_types, concrete_types
from messages.__main__ import main
from messages.schema import (
    FieldLayout,
    Layout,
    TypeLayout,
    catalogue_schema,
    compare_layouts,
    fingerprint,
    layout_from_json,
    layout_from_schema,
    layout_to_json,
    wire_layout,
)


def _saved(tmp_path: Path, edit: object = None) -> Path:
    doc = json.loads(json.dumps(catalogue_schema()))  # as a saved file reads back
    if callable(edit):
        edit(doc["x-layout"])
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    return path


def test_schema_is_msgspec_json_schema_with_layout_and_fingerprint() -> None:
    doc = catalogue_schema()
    defs = doc["$defs"]
    assert isinstance(defs, dict)
    names = {t.__name__ for t in catalogue_types()}
    assert names <= defs.keys()
    assert {r["$ref"].rsplit("/", 1)[1] for r in doc["anyOf"]} == names  # type: ignore[attr-defined]
    gen = defs["TokenizedGenerateReqInput"]
    assert gen["type"] == "array"
    assert gen["prefixItems"][0] == {"enum": ["TokenizedGenerateReqInput"]}  # the tag, item 0
    assert "ext 3" in json.dumps(gen)  # the tensor hook described input_embeds
    assert doc["x-fingerprint"] == fingerprint(wire_layout())
    assert layout_from_schema(json.loads(json.dumps(doc))) == wire_layout()


def test_catalogue_is_the_messages_package_only() -> None:
    class Local(Message):  # a test's own message is no part of the wire contract
        x: int

    assert Local in concrete_types(Message) and Local not in catalogue_types()
    assert "Local" not in wire_layout()


def test_layout_names_tags_fields_in_order_and_types() -> None:
    layout = wire_layout()
    gen = layout["TokenizedGenerateReqInput"]
    assert gen.tag == "TokenizedGenerateReqInput"
    assert [f.name for f in gen.fields][:4] == ["rid", "input_ids", "sampling", "stream"]
    assert gen.fields[1] == FieldLayout("input_ids", "packed_u32", True)
    assert layout["SamplingParams"].tag is None  # nested, untagged
    assert layout["BatchTokenIDOut"].fields[0] == FieldLayout("rids", "str", True)
    assert "ndarray[float32]|null" in {f.type for f in layout["BatchTokenIDOut"].fields}
    assert layout_from_json(layout_to_json(layout)) == layout


def test_fingerprint_is_stable_and_sensitive() -> None:
    layout = wire_layout()
    assert fingerprint(layout) == fingerprint(dict(reversed(layout.items())))
    changed = dict(layout)
    abort = changed["AbortReq"]
    changed["AbortReq"] = TypeLayout(abort.tag, (*abort.fields, FieldLayout("x", "int", False)))
    assert fingerprint(changed) != fingerprint(layout)


def _one(fields: list[FieldLayout], tag: str = "T") -> Layout:
    return {"T": TypeLayout(tag, tuple(fields))}


A, B = FieldLayout("a", "int", True), FieldLayout("b", "str", True)
C = FieldLayout("c", "int", False)


@pytest.mark.parametrize(("old", "new", "change", "field", "breaking"), [
    ([A, B], [A, B, C], "field_added", "c", False),
    ([A, B], [A, B, FieldLayout("c", "int", True)], "field_added", "c", True),
    ([A, B, C], [A, B], "field_removed", "c", True),
    ([A, B, C], [A, C], "field_removed", "b", True),
    ([A, C], [A, B, C], "field_added", "b", True),
    ([A, B], [B, A], "field_reordered", "a", True),
    ([A, B], [A, FieldLayout("b", "int", True)], "field_retyped", "b", True),
    ([A, C], [A, FieldLayout("c", "int", True)], "field_now_required", "c", True),
    ([A, B], [A, FieldLayout("name", "str", True)], "field_renamed", "b", False),
    ([FieldLayout("k", 'literal["x"]', True)], [FieldLayout("k", 'literal["x","y"]', True)],
     "literal_widened", "k", False),
    ([FieldLayout("k", 'list[literal["x","y"]|null]', True)],
     [FieldLayout("k", 'list[literal["x"]|null]', True)], "literal_narrowed", "k", True),
])
def test_compare_classifies_each_change(old: list[FieldLayout], new: list[FieldLayout],
                                        change: str, field: str, breaking: bool) -> None:
    diffs = compare_layouts(_one(old), _one(new))
    assert (change, field, breaking) in [(d.change, d.field, d.breaking) for d in diffs], diffs


def test_compare_types_added_removed_and_tags_renamed() -> None:
    assert compare_layouts(_one([A]), _one([A])) == []
    [renamed] = compare_layouts(_one([A], tag="Old"), _one([A], tag="New"))
    assert renamed.breaking and "Old" in renamed.detail and "New" in renamed.detail
    [gone] = compare_layouts(_one([A]), {})
    assert gone.breaking and gone.change == "type_removed" and str(gone).startswith("breaking: T")
    [added] = compare_layouts({}, _one([A]))
    assert not added.breaking and added.change == "type_added"


def test_check_same_schema_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(_saved(tmp_path))]) == 0
    assert "no difference" in capsys.readouterr().out


def test_check_a_removed_field_exits_1_naming_it(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # The saved schema has a field the current catalogue lacks: it was removed.
    def add(layout: dict[str, dict[str, list[dict[str, object]]]]) -> None:
        layout["AbortReq"]["fields"].append({"name": "reason", "type": "str", "required": False})

    assert main(["check", str(_saved(tmp_path, add))]) == 1
    out = capsys.readouterr().out
    assert "breaking: AbortReq.reason: field removed" in out


def test_check_an_appended_optional_field_is_compatible(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def drop_last(layout: dict[str, dict[str, list[object]]]) -> None:
        layout["RpcReqOutput"]["fields"].pop()  # the saved side predates `result`

    assert main(["check", str(_saved(tmp_path, drop_last))]) == 0
    assert "compatible: RpcReqOutput.result: optional field appended" in capsys.readouterr().out


def test_check_unreadable_file_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["check", str(bad)]) == 2
    assert main(["check", str(tmp_path / "missing.json")]) == 2
    assert main(["nonsense"]) == 2


def test_cli_schema_then_check_round_trip(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    # `python -m messages` once as its own process (the entry point), then in this one.
    run = subprocess.run([sys.executable, "-m", "messages", "schema"], capture_output=True,
                         text=True, timeout=120, check=True)
    doc = json.loads(run.stdout)
    assert f"fingerprint: {doc['x-fingerprint']}" in run.stderr
    fields = doc["x-layout"]["ErrorOut"]["fields"]
    fields.insert(1, {"name": "gone", "type": "int", "required": True})
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    assert main(["check", str(path)]) == 1
    assert "breaking: ErrorOut.gone: field removed" in capsys.readouterr().out


def test_layout_records_are_strict() -> None:
    with pytest.raises(msgspec.ValidationError):
        layout_from_json('{"T": {"tag": "T", "fields": [], "extra": 1}}')


def test_check_another_protocol_version_is_breaking(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = _saved(tmp_path)
    doc = json.loads(saved.read_text())
    doc["x-protocol-version"] = 1  # before bursts
    saved.write_text(json.dumps(doc))
    assert main(["check", str(saved)]) == 1
    assert "breaking: protocol version 1 (saved) vs 2" in capsys.readouterr().out
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    assert main(["check", str(deep)]) == 2  # unreadable, not a crash
