"""Naming what failed: the cold path of :class:`~messages.Codec`, kept out of its hot one.

Every attacker reaches this code (each rejected frame runs it), so it is
flat, bounded and cheap: frame 0 is parsed once, shallowly, for the tag and
rid; the field is named from the tag and msgspec's error path alone (never
from the value), from type info inspected once per codec, and cached per
(tag, path) in a bounded dict. :meth:`FailureNamer.failure` never raises.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import Final

import msgspec

from messages.base import ABSTRACT_MESSAGE_TYPES, Message, Rid
from messages.errors import DecodeError, EncodeError, NotCarried

__all__ = ["HOMES", "FailureNamer", "find_field", "invalid", "unencodable"]

Frame = bytes | bytearray | memoryview
_PATH_TOKENS: Final = re.compile(r"\[(\d+|\"(?:[^\"\\]|\\.)*\"|\.\.\.)\]|\.(\w+)")


class FailureNamer:
    """Turns a decode failure into a :class:`DecodeError` naming the field, tag and rid."""

    def __init__(self, types: Sequence[type[Message]], channel: str | None = None) -> None:
        self.types = tuple(types)
        #: The channel whose door this is (``None``: a codec with no channel).
        self.channel = channel
        self.by_tag: dict[str, type[Message]] = {
            str(msgspec.inspect.type_info(t).tag): t  # type: ignore[attr-defined]
            for t in self.types
        }
        # Where a rejected message's rid sits in its array (the tag is item 0).
        self.rid_at: dict[str, int] = {
            tag: t.__struct_fields__.index("rid") + 1
            for tag, t in self.by_tag.items() if "rid" in t.__struct_fields__
        }
        # The type tree, inspected on the first failure rather than per
        # failure, and (tag, msgspec path) -> name.
        self._infos: dict[str, msgspec.inspect.StructType] | None = None
        self.names: dict[tuple[str | None, str], str] = {}
        # Tag -> rid position of every message type *not* decoded here, built on
        # the first such failure (the types are all defined by then).
        self._foreign: dict[str, int | None] | None = None
        self.carried = tuple(sorted(self.by_tag))

    def failure(self, frames: Sequence[Frame], exc: Exception) -> DecodeError:
        """The DecodeError for ``exc``, naming what it can. Never raises.

        Frame 0 is parsed once here, shallowly (its items as raw views), for
        the tag and the rid; the field is named from the tag and msgspec's
        path alone, so no value steers the walk and its result can be cached.
        """
        tag: str | None = None
        rid: str | None = None
        try:
            reason = str(exc) or type(exc).__name__
        except Exception:  # a str() that fails: still a DecodeError
            reason = type(exc).__name__
        try:
            tag, rid, known = self.peek(frames)
            if (not known and tag is not None and self.channel is not None
                    and tag in self._foreign_tags()):
                return NotCarried(self._not_carried(tag), channel=self.channel,
                                  carried=self.carried, rid=rid, message_type=tag)
            if isinstance(exc, msgspec.ValidationError):
                reason = self.name_field(tag if known else None, reason)
        except Exception:  # naming is best effort: msgspec's text still says what is wrong
            pass
        return DecodeError(reason, rid=rid, message_type=tag)

    def not_carried(self, msg: Message) -> NotCarried:
        """The refusal of ``msg``, a message of a type this channel does not carry
        (the sending side's door, or an in-process one). Never raises."""
        tag = type(msg).__name__
        rid = getattr(msg, "rid", None)
        return NotCarried(self._not_carried(tag), channel=self.channel or "?",
                          carried=self.carried, rid=rid if isinstance(rid, str) else None,
                          message_type=tag)

    def _not_carried(self, tag: str) -> str:
        where = f"the {self.channel!r} channel" if self.channel else "this channel"
        text = f"{tag} is not carried on {where} (it carries {', '.join(self.carried)})"
        home = HOMES.get(tag)
        return f"{text}; send it on the {home!r} channel" if home else text

    def _foreign_tags(self) -> dict[str, int | None]:
        """Tag -> rid position (None: no rid) of every message type not decoded here."""
        if self._foreign is None:
            found: dict[str, int | None] = {}
            todo: list[type[Message]] = [Message]
            while todo:
                cls = todo.pop()
                todo.extend(cls.__subclasses__())
                tag = msgspec.inspect.type_info(cls).tag  # type: ignore[attr-defined]
                if (cls in ABSTRACT_MESSAGE_TYPES or not isinstance(tag, str)
                        or tag in self.by_tag):
                    continue
                fields = cls.__struct_fields__
                found[tag] = fields.index("rid") + 1 if "rid" in fields else None
            self._foreign = found
        return self._foreign

    def peek(self, frames: Sequence[Frame]) -> tuple[str | None, str | None, bool]:
        """(tag, rid, whether the tag is one of ours) of an undecodable message."""
        try:
            items = _PEEK.decode(frames[0])
            tag = _TAG.decode(items[0])[:128]
        except Exception:  # not a tagged array: nothing to read
            return None, None, False
        known = tag in self.by_tag
        if known:
            i = self.rid_at.get(tag)
        else:
            # Another channel's type: its rid where it has one. An unknown tag:
            # item 1, where every request keeps its rid (docs/PROTOCOL.md, 7).
            i = self._foreign_tags().get(tag, 1)
        if i is None or i >= len(items):
            return tag, None, known
        try:
            return tag, _RID.decode(items[i]), known
        except Exception:  # a rid that is not a valid one is not an address
            return tag, None, known

    def name_field(self, tag: str | None, reason: str) -> str:
        """``Expected ... - at `$[3][2]``` -> ``sampling.top_p: Expected ...``."""
        message, sep, where = reason.rpartition(" - at `")
        if not sep:
            return reason
        key = (tag, where)
        names = self.names
        name = names.get(key)
        if name is None:
            if len(names) >= _MAX_NAMES:  # paths carry indices: bound what a sender can grow
                names.clear()
            name = names[key] = self._walk(tag, where.rstrip("`"))
        return f"{name}: {message}" if name else reason

    def _walk(self, tag: str | None, where: str) -> str:
        """Name the field a msgspec path points at, from the types alone ("" if unsure)."""
        if where.startswith("key` in `"):  # a dict key: name the dict
            where = where[len("key` in `"):]
        if not where.startswith("$"):
            return ""
        tokens = _PATH_TOKENS.findall(where, 1)
        infos = self._infos
        if infos is None:
            infos = self._infos = {
                str(info.tag): info
                for info in msgspec.inspect.multi_type_info(self.types)
                if isinstance(info, msgspec.inspect.StructType)
            }
        node: object = infos.get(tag) if tag is not None else None
        if node is None:
            return "message type" if tokens[:1] == [("0", "")] else ""
        parts: list[str] = []
        for index, attr in tokens:
            node = _member(node, index)
            if isinstance(node, msgspec.inspect.StructType):
                name, node = _struct_step(node, index, attr)
                if name is None:
                    break
                parts.append(("." if parts else "") + name)
                continue
            parts.append(f"[{index}]" if index else f".{attr}")
            if isinstance(node, msgspec.inspect.DictType):
                node = node.value_type
            elif isinstance(node, msgspec.inspect.ListType | msgspec.inspect.VarTupleType
                            | msgspec.inspect.SetType | msgspec.inspect.FrozenSetType):
                node = node.item_type
            elif isinstance(node, msgspec.inspect.TupleType) and index.isdigit():
                i = int(index)
                node = node.item_types[i] if i < len(node.item_types) else None
            else:
                node = None
        return "".join(parts)


#: Tag -> the channel that carries it to a scheduler, for error texts; filled by
#: :mod:`messages.channels` when it declares them (it imports this module, not
#: the other way round).
HOMES: Final[dict[str, str]] = {}
#: Most cached (tag, path) -> name entries before the cache starts over.
_MAX_NAMES: Final = 4096
# The top-level items of frame 0 as raw views: enough for the tag and the rid,
# without building (or copying) the rest of a message that failed.
_PEEK: Final = msgspec.msgpack.Decoder(list[msgspec.Raw])
_TAG: Final = msgspec.msgpack.Decoder(str)
_RID: Final = msgspec.msgpack.Decoder(Rid)
_ARRAY_LIKE: Final = (
    msgspec.inspect.ListType, msgspec.inspect.VarTupleType, msgspec.inspect.TupleType,
    msgspec.inspect.SetType, msgspec.inspect.FrozenSetType,
)


def _member(node: object, index: str) -> object:
    """The member of a union that a path step can enter, or None if not exactly one.

    Chosen by the step alone (``[3]`` enters an array, ``[...]`` a dict), not
    by the value: two members of one kind (two tagged structs) are not
    guessed between.
    """
    if not isinstance(node, msgspec.inspect.UnionType):
        return node
    fits: list[msgspec.inspect.Type]
    if index.isdigit():
        fits = [t for t in node.types if isinstance(t, _ARRAY_LIKE)
                or (isinstance(t, msgspec.inspect.StructType) and t.array_like)]
    elif index:
        fits = [t for t in node.types if isinstance(t, msgspec.inspect.DictType)]
    else:
        fits = [t for t in node.types
                if isinstance(t, msgspec.inspect.StructType) and not t.array_like]
    return fits[0] if len(fits) == 1 else None


def _struct_step(
    info: msgspec.inspect.StructType, index: str, attr: str
) -> tuple[str | None, object]:
    """(field name, field type) of a path step into a struct; (None, None) if none."""
    if attr:
        field = next((f for f in info.fields if f.encode_name == attr), None)
    elif index.isdigit():
        pos = int(index) - (1 if info.tag is not None else 0)
        if pos == -1:
            return "message type", None
        field = info.fields[pos] if pos < len(info.fields) else None
    else:
        field = None
    return (field.name, field.type) if field is not None else (None, None)


def invalid(msg: object, exc: Exception) -> DecodeError:
    """The DecodeError :meth:`~messages.Codec.validate` raises for ``msg``. Never raises."""
    try:
        if isinstance(exc, EncodeError):
            reason = f"{exc.field}: {exc.reason}" if exc.field else exc.reason
        elif isinstance(exc, DecodeError):
            reason = exc.reason
        else:
            reason = str(exc) or type(exc).__name__
    except Exception:  # a str() that fails: still a DecodeError
        reason = type(exc).__name__
    try:
        rid = getattr(msg, "rid", None)
    except Exception:  # a property that raises: no address
        rid = None
    return DecodeError(reason, rid=rid if isinstance(rid, str) else None,
                       message_type=type(msg).__name__)


def _children(value: object, prefix: str) -> Iterator[tuple[str, object]]:
    """(dotted path, child) of each field / item / entry (key, then value) of ``value``."""
    if isinstance(value, msgspec.Struct):
        for name in value.__struct_fields__:
            yield (f"{prefix}.{name}" if prefix else name), getattr(value, name)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield f"{prefix}[{i}]", item
    elif isinstance(value, dict):
        for key, item in value.items():
            yield f"{prefix}[{key!r}]", key
            yield f"{prefix}[{key!r}]", item


def find_field(
    msg: object, match: Callable[[object], bool], prefix: str = "", depth: int = 0
) -> str:
    """Dotted path of the first field of ``msg`` whose value ``match``es, or ``""``."""
    if depth > 8:
        return ""
    for path, value in _children(msg, prefix):
        if match(value):
            return path
        found = find_field(value, match, path, depth + 1)
        if found:
            return found
    return ""


def unencodable(value: object) -> bool:
    """Whether msgpack cannot carry ``value``: an int past 64 bits or a non-UTF-8 str."""
    if isinstance(value, int) and not isinstance(value, bool):
        return not -(1 << 63) <= value < (1 << 64)
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return True
    return False
