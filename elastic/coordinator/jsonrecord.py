"""One JSON form for every record, derived from its keyword-only dataclass fields.

A record (what goes into etcd or the run directory) subclasses `JsonRecord` and gets `to_dict`,
`from_dict`, `to_json` and `from_json` from its fields: nested dataclasses become objects,
lists and tuples arrays, dicts objects (int keys written as strings), optionals null, and a
type with its own `to_dict`/`from_dict` (the plan, `templates.plan.Plan`) keeps its format.
A field with `metadata=INLINE` writes the fields of its dataclass into the enclosing object, and a
`list[int]` field with `metadata=RUNS` writes its sorted integers as runs (`[0, [2, 9]]` for
0, 2, 3, ..., 9: a run of 16,384 ranks is 2 numbers) and reads runs or plain integers.

`to_json` adds the record's schema version under `"v"`; `from_json` reads a record without one
as version 1 (what every record was before versions existed) and refuses a newer version.
`to_packed` is the same text as stored in etcd: zlib-compressed (RFC 1950) when it is at least
`PACK_MIN_BYTES` long and that makes it shorter. A large record repeats its field names and
numbers so often that it packs about 7x (a 2,048-node generation record: 185 KB to 28 KB, sent to
every node), and a node's small records about 2x (its 8 workers' registrations 1,973 B to 354 B,
its holdings 232 B to 105 B), which etcd keeps, with their history, for every node. `from_json`
reads either form: packed text begins with byte 0x78, JSON never does. Any
record that cannot be read raises `RecordError` (a ValueError) naming the record type and the
field, e.g. `SyncReport.last_vote.step: expected int, got str 'x'`.

`to_data`/`from_data` are the same conversion for a plain dataclass that is not a record of
its own (a record's nested parts, the simulator's cluster). Imports nothing of the project:
every package above the coordinator may use it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
import zlib
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Self, TypeVar, Union

VERSION_KEY = "v"
"""The key of a record's schema version in its JSON object."""

INLINE: Mapping[str, Any] = types.MappingProxyType({"json": "inline"})
"""Field metadata: write the nested dataclass's fields into the enclosing object (no sub-object)."""

RUNS: Mapping[str, Any] = types.MappingProxyType({"json": "runs"})
"""Field metadata of a sorted `list[int]`: written as runs (a lone integer, or [first, last] of
consecutive ones), read from runs or plain integers."""

MAX_RUN = 1 << 24
"""The longest run a record may hold (a malformed one must not make a reader allocate without bound)."""

PACK_MIN_BYTES = 128
"""`to_packed` compresses text at least this long (and keeps the text when that is shorter): below
it zlib's 6 bytes of framing eat most of the gain. `elastic status` and `elastic events` read
every record; etcdctl shows a packed one as bytes."""

MAX_UNPACKED_BYTES = 256 * 2**20
"""The most a packed value may unpack to (etcd's values are at most 1.5 MiB; zlib's worst case is ~1000x)."""

_ZLIB_FIRST = 0x78
"""The first byte of a zlib stream with the default 32 KiB window (RFC 1950's CMF), at any level."""

T = TypeVar("T")


class RecordError(ValueError):
    """A record that cannot be read: not JSON, an unknown or newer schema version, a missing or
    unknown field, or a value of the wrong type. The message names the record type and the field."""


class JsonRecord:
    """Mixin of a keyword-only dataclass stored as JSON: the conversions come from its fields."""

    VERSION: ClassVar[int] = 1
    """Schema version written with the record. Raise it when a field changes meaning or an older
    reader could not read the new form; readers refuse versions above their own."""

    def to_dict(self) -> dict[str, Any]:
        """The record as a JSON-ready object (no version: it may be nested in another record)."""
        return to_data(self)

    @classmethod
    def from_dict(cls, data: Any) -> Self:
        """The record from `to_dict`'s object; RecordError naming the field otherwise."""
        return from_data(cls, data)

    def to_json(self, *, indent: int | None = None) -> str:
        """The record with its schema version, keys sorted."""
        return json.dumps({VERSION_KEY: self.VERSION, **self.to_dict()}, indent=indent, sort_keys=True)

    def to_packed(self) -> bytes:
        """`to_json`'s text as stored: zlib-compressed from `PACK_MIN_BYTES` on, when shorter (`pack_text`)."""
        return pack_text(self.to_json())

    @classmethod
    def from_json(cls, text: str | bytes) -> Self:
        """The record from `to_json`'s text, or `to_packed`'s bytes (or a version-less one of version 1)."""
        return cls.from_parsed(parse_text(text, cls.__name__))

    @classmethod
    def from_parsed(cls, data: Any) -> Self:
        """The record from `to_json`'s text already parsed (`json.loads`): for a reader that
        parsed it to tell two record types apart. Takes `data` over (its version key is removed)."""
        name = cls.__name__
        if not isinstance(data, dict):
            raise RecordError(f"{name}: expected a JSON object, got {type(data).__name__}")
        version = data.pop(VERSION_KEY, 1)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise RecordError(f"{name}.{VERSION_KEY}: unknown schema version {version!r}")
        if version > cls.VERSION:
            raise RecordError(
                f"{name}.{VERSION_KEY}: schema version {version} is newer than this code reads ({cls.VERSION})"
            )
        return from_data(cls, data)


def parse_text(text: str | bytes, name: str) -> Any:
    """`text` (or a packed value) parsed as JSON; RecordError naming `name` when it is not JSON or
    its packing is corrupt. For a reader that tells record types apart before decoding one."""
    try:
        return json.loads(unpack_text(text))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RecordError(f"{name}: not valid JSON: {exc}") from None
    except RecordError as exc:
        raise RecordError(f"{name}: {exc}") from None


def pack_text(text: str) -> bytes:
    """`text` encoded, zlib-compressed when it is at least PACK_MIN_BYTES long and that is shorter."""
    raw = text.encode()
    if len(raw) < PACK_MIN_BYTES:
        return raw
    packed = zlib.compress(raw)
    return packed if len(packed) < len(raw) else raw


@typing.overload
def unpack_text(value: bytes) -> bytes: ...
@typing.overload
def unpack_text(value: str) -> str: ...
def unpack_text(value: bytes | str) -> bytes | str:
    """What `pack_text` was given, encoded: `value` itself unless it is packed (text never is).
    RecordError for a packed value that is corrupt or would unpack to more than MAX_UNPACKED_BYTES."""
    if isinstance(value, str) or not value or value[0] != _ZLIB_FIRST:
        return value
    inflate = zlib.decompressobj()
    try:
        out = inflate.decompress(value, MAX_UNPACKED_BYTES)
    except zlib.error as exc:
        raise RecordError(f"a packed record is corrupt: {exc}") from None
    if inflate.unconsumed_tail:
        raise RecordError(f"a packed record unpacks to more than {MAX_UNPACKED_BYTES} bytes")
    if not inflate.eof or inflate.unused_data:
        raise RecordError("a packed record is truncated or has bytes after its end")
    return out


_DERIVED_FROM_DICT = JsonRecord.from_dict.__func__  # type: ignore[attr-defined]


# ---- writing -------------------------------------------------------------------------------


def to_data(obj: Any) -> dict[str, Any]:
    """A dataclass instance as a JSON-ready object, field by field (INLINE fields merged in)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value: Any = _runs(getattr(obj, f.name)) if f.metadata.get("json") == "runs" else _encode(getattr(obj, f.name))
        if f.metadata.get("json") == "inline":
            out.update(value)
        else:
            out[f.name] = value
    return out


def _runs(values: list[int]) -> list[int | list[int]]:
    """Sorted distinct integers as runs: a lone one as itself, consecutive ones as [first, last]."""
    out: list[int | list[int]] = []
    start = prev = None
    for v in sorted(set(values)):
        if prev is not None and v == prev + 1:
            prev = v
            continue
        if start is not None and prev is not None:
            out.append(start if start == prev else [start, prev])
        start = prev = v
    if start is not None and prev is not None:
        out.append(start if start == prev else [start, prev])
    return out


def _from_runs(data: Any, where: str) -> list[int]:
    """The integers of `_runs`'s form (plain integers read as themselves), ascending."""
    out: list[int] = []
    for i, item in enumerate(_array(data, where)):
        if isinstance(item, list):
            if len(item) != 2:
                raise RecordError(f"{where}[{i}]: expected [first, last], got {_shown(item)}")
            first, last = (_scalar(int, v, f"{where}[{i}]") for v in item)
            if not 0 <= last - first < MAX_RUN:
                raise RecordError(f"{where}[{i}]: run [{first}, {last}] is not 1 to {MAX_RUN} integers")
            out.extend(range(first, last + 1))
        else:
            out.append(_scalar(int, item, f"{where}[{i}]"))
    return sorted(set(out))


def _encode(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):  # a record, or a type with a format of its own (the plan)
        return to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_data(value)
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    raise TypeError(f"cannot write a {type(value).__name__} as JSON: {value!r}")


# ---- reading -------------------------------------------------------------------------------


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_data(cls: type[T], data: Any, *, where: str | None = None) -> T:
    """The dataclass `cls` from `to_data`'s object: every field checked against its type; a
    missing field takes its default. RecordError naming `where` (default: the class name) and
    the field when the object does not fit."""
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise RecordError(f"{where}: expected a JSON object, got {_shown(data)}")
    kwargs, used = _fields_from(cls, data, where)
    unknown = sorted(set(data) - used)
    if unknown:
        raise RecordError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:  # the dataclass's own checks (__post_init__)
        if isinstance(exc, RecordError):
            raise
        raise RecordError(f"{where}: {exc}") from exc


def _fields_from(cls: type, data: dict[str, Any], where: str) -> tuple[dict[str, Any], set[str]]:
    """Constructor arguments of `cls` read from `data`, and the keys of `data` they used."""
    types_ = _field_types(cls)
    kwargs: dict[str, Any] = {}
    used: set[str] = set()
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.metadata.get("json") == "inline":
            inner = types_[f.name]
            names = {g.name for g in dataclasses.fields(inner)}
            part = {k: v for k, v in data.items() if k in names}
            kwargs[f.name] = from_data(inner, part, where=where)
            used |= set(part)
        elif f.name in data and f.metadata.get("json") == "runs":
            kwargs[f.name] = _from_runs(data[f.name], f"{where}.{f.name}")
            used.add(f.name)
        elif f.name in data:
            kwargs[f.name] = _decode(types_[f.name], data[f.name], f"{where}.{f.name}")
            used.add(f.name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise RecordError(f"{where}: missing field {f.name!r}")
    return kwargs, used


def _decode(tp: Any, data: Any, where: str) -> Any:
    """`data` read as a value of type `tp`; RecordError naming `where` when it is not one."""
    if tp is Any:
        return data
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return _decode_union(args, data, where)
    if origin is Literal:
        if data not in args:
            raise RecordError(f"{where}: expected one of {', '.join(map(repr, args))}, got {_shown(data)}")
        return data
    if origin is list or tp is list:
        return [_decode(args[0] if args else Any, v, f"{where}[{i}]") for i, v in enumerate(_array(data, where))]
    if origin is tuple or tp is tuple:
        return _decode_tuple(args, data, where)
    if origin is dict or tp is dict:
        return _decode_dict(args, data, where)
    if tp in (bool, int, float, str):
        return _scalar(tp, data, where)
    if isinstance(tp, type):
        if _own_format(tp):  # the plan
            try:
                return tp.from_dict(data)  # type: ignore[attr-defined]
            except (ValueError, TypeError, KeyError) as exc:
                raise RecordError(f"{where}: {exc}") from exc
        if dataclasses.is_dataclass(tp):
            return from_data(tp, data, where=where)
    raise TypeError(f"{where}: records cannot hold a field of type {tp!r}")


def _own_format(tp: type) -> bool:
    """Whether `tp` reads its JSON form with a `from_dict` of its own (not the derived one)."""
    from_dict = getattr(tp, "from_dict", None)
    return from_dict is not None and getattr(from_dict, "__func__", None) is not _DERIVED_FROM_DICT


def _decode_union(args: tuple[Any, ...], data: Any, where: str) -> Any:
    if data is None and type(None) in args:
        return None
    options = [a for a in args if a is not type(None)]
    errors = []
    for option in options:
        try:
            return _decode(option, data, where)
        except RecordError as exc:
            errors.append(exc)
    if len(errors) == 1:
        raise errors[0]
    names = " or ".join(getattr(a, "__name__", repr(a)) for a in args)
    raise RecordError(f"{where}: expected {names}, got {_shown(data)}")


def _decode_tuple(args: tuple[Any, ...], data: Any, where: str) -> tuple[Any, ...]:
    items = _array(data, where)
    if not args or (len(args) == 2 and args[1] is Ellipsis):
        inner = args[0] if args else Any
        return tuple(_decode(inner, v, f"{where}[{i}]") for i, v in enumerate(items))
    if len(items) != len(args):
        raise RecordError(f"{where}: expected {len(args)} items, got {len(items)}")
    return tuple(_decode(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, items, strict=True)))


def _decode_dict(args: tuple[Any, ...], data: Any, where: str) -> dict[Any, Any]:
    if not isinstance(data, dict):
        raise RecordError(f"{where}: expected a JSON object, got {_shown(data)}")
    key_type, value_type = args if args else (str, Any)
    out = {}
    for k, v in data.items():
        if key_type is int:
            try:
                key: Any = int(k)
            except ValueError:
                raise RecordError(f"{where}: key {k!r} is not an integer") from None
        else:
            key = _decode(key_type, k, f"{where} key")
        out[key] = _decode(value_type, v, f"{where}[{k!r}]")
    return out


def _array(data: Any, where: str) -> list[Any]:
    if not isinstance(data, list):
        raise RecordError(f"{where}: expected an array, got {_shown(data)}")
    return data


def _scalar(tp: type, data: Any, where: str) -> Any:
    if tp is float and isinstance(data, int) and not isinstance(data, bool):
        return float(data)  # a float field set to an int (`at=0`) was written as an integer
    if isinstance(data, tp) and (tp is bool or not isinstance(data, bool)):
        return data
    raise RecordError(f"{where}: expected {tp.__name__}, got {_shown(data)}")


def _shown(data: Any) -> str:
    text = repr(data)
    return f"{type(data).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
