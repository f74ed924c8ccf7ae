"""The detokenizer's ASCII path (text decoded in C, the incremental decoder skipped)
keeps the decoder's rules: bytes held from an unfinished character are read with
what follows (replaced when the ASCII shows them invalid), never dropped; and an
event's text with no line-end character is sent as it is."""

from __future__ import annotations

from frontend import ByteTokenizer
from frontend.detokenizer import Detokenizer
from frontend.schemas import sse_safe

TOK = ByteTokenizer()


def test_ascii_after_held_bytes_replaces_them_first() -> None:
    detok = Detokenizer(TOK)
    assert detok.push([0xE4]) == ""  # the lead byte of a 3-byte character: held
    assert detok.push([ord("a")]) == "\ufffda"  # shown invalid by the ASCII after it
    assert detok.push([ord("b")]) == "b"


def test_a_character_split_over_steps_then_ascii() -> None:
    detok = Detokenizer(TOK)
    raw = "é".encode()
    assert detok.push([raw[0]]) == ""
    assert detok.push([raw[1], ord("x")]) == "éx"
    assert detok.push([ord("y"), ord("z")]) == "yz"
    assert detok.finish() == ""


def test_ascii_steps_are_their_own_text() -> None:
    detok = Detokenizer(TOK)
    assert [detok.push([b]) for b in b"hi there"] == list("hi there")
    assert detok.tokens == 8 and detok.chars == 8


def test_sse_safe_leaves_ascii_as_it_is_and_escapes_line_ends() -> None:
    data = b'"plain text"'
    assert sse_safe(data) is data
    assert sse_safe('"a\u2028b\u0085"'.encode()) == b'"a\\u2028b\\u0085"'
