"""The JSON-record base (elastic/coordinator/jsonrecord.py) on small records of its own: the form
derived from the fields, the schema version, and one clear error naming the record and the field
for every kind of bad input. The project's records themselves: tests/records/test_record_json.py."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from elastic.coordinator.jsonrecord import INLINE, VERSION_KEY, JsonRecord, RecordError, from_data, to_data


@dataclass(frozen=True, kw_only=True)
class Point:
    """A nested plain dataclass (no methods of its own)."""

    x: int
    y: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Cost:
    """Fields written inline into their owner."""

    seconds: float
    bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class Sample(JsonRecord):
    """One field of every shape the base supports."""

    name: str
    kind: Literal["a", "b"]
    count: int
    ratio: float
    flag: bool
    maybe: int | None
    pair: tuple[int, int]
    ids: tuple[int, ...]
    rows: list[list[float]]
    by_node: dict[int, int]
    tags: dict[str, str]
    where: Point
    points: list[Point]
    cost: Cost = field(metadata=INLINE)
    extra: dict[str, Any] = field(default_factory=dict)
    optional_point: Point | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count}")


@dataclass(frozen=True, kw_only=True)
class Newer(JsonRecord):
    VERSION = 2

    a: int


def sample() -> Sample:
    return Sample(name="s", kind="b", count=3, ratio=0.5, flag=True, maybe=None, pair=(1, 2), ids=(4, 5, 6),
                  rows=[[1.0, 2.5], []], by_node={0: 1, 12: 3}, tags={"k": "v"}, where=Point(x=1, y=2.5),
                  points=[Point(x=2), Point(x=3, y=1.5)], cost=Cost(seconds=0.25, bytes=10),
                  extra={"any": [1, "two", None]}, optional_point=Point(x=-1))


def good() -> dict[str, Any]:
    return json.loads(sample().to_json())


def test_round_trip_and_form() -> None:
    s = sample()
    text = s.to_json()
    assert Sample.from_json(text) == s
    assert Sample.from_json(text.encode()) == s
    assert Sample.from_dict(s.to_dict()) == s
    data = json.loads(text)
    assert data[VERSION_KEY] == 1
    assert data["pair"] == [1, 2] and data["by_node"] == {"0": 1, "12": 3}
    assert data["where"] == {"x": 1, "y": 2.5}
    assert data["seconds"] == 0.25 and data["bytes"] == 10 and "cost" not in data  # inline
    assert VERSION_KEY not in s.to_dict()  # a nested record carries no version of its own
    assert list(data) == sorted(data)
    assert json.loads(s.to_json(indent=1)) == data


def test_plain_dataclass_functions() -> None:
    p = Point(x=4, y=1.0)
    assert to_data(p) == {"x": 4, "y": 1.0}
    assert from_data(Point, {"x": 4}) == Point(x=4)
    with pytest.raises(RecordError, match=r"^Point\.x: expected int, got str '4'$"):
        from_data(Point, {"x": "4"})


def test_unversioned_is_version_1_and_defaults_fill_missing_optional_fields() -> None:
    data = good()
    del data[VERSION_KEY], data["note"], data["extra"], data["optional_point"]
    s = Sample.from_json(json.dumps(data))
    assert s.note == "" and s.extra == {} and s.optional_point is None


def test_an_int_is_read_as_a_float_but_not_the_reverse() -> None:
    data = good()
    data["ratio"] = 2
    value = Sample.from_json(json.dumps(data)).ratio
    assert value == 2.0 and isinstance(value, float)


@pytest.mark.parametrize(
    ("version", "message"),
    [
        (2, r"^Sample\.v: schema version 2 is newer than this code reads \(1\)$"),
        (0, r"^Sample\.v: unknown schema version 0$"),
        ("1", r"^Sample\.v: unknown schema version '1'$"),
        (True, r"^Sample\.v: unknown schema version True$"),
    ],
)
def test_unknown_or_newer_version(version: object, message: str) -> None:
    data = {**good(), VERSION_KEY: version}
    with pytest.raises(RecordError, match=message):
        Sample.from_json(json.dumps(data))


def test_a_record_reads_its_own_older_versions() -> None:
    assert Newer.from_json('{"a": 1}') == Newer(a=1)
    assert Newer.from_json('{"v": 1, "a": 1}') == Newer(a=1)
    assert json.loads(Newer(a=1).to_json())[VERSION_KEY] == 2
    with pytest.raises(RecordError, match=r"^Newer\.v: schema version 3 is newer"):
        Newer.from_json('{"v": 3, "a": 1}')


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"count": "3"}, r"^Sample\.count: expected int, got str '3'$"),
        ({"count": 2.5}, r"^Sample\.count: expected int, got float 2\.5$"),
        ({"count": True}, r"^Sample\.count: expected int, got bool True$"),
        ({"ratio": "x"}, r"^Sample\.ratio: expected float, got str 'x'$"),
        ({"flag": 1}, r"^Sample\.flag: expected bool, got int 1$"),
        ({"name": None}, r"^Sample\.name: expected str, got NoneType None$"),
        ({"kind": "c"}, r"^Sample\.kind: expected one of 'a', 'b', got str 'c'$"),
        ({"maybe": "x"}, r"^Sample\.maybe: expected int, got str 'x'$"),
        ({"pair": [1]}, r"^Sample\.pair: expected 2 items, got 1$"),
        ({"pair": {"a": 1}}, r"^Sample\.pair: expected an array, got dict"),
        ({"ids": [1, "x"]}, r"^Sample\.ids\[1\]: expected int, got str 'x'$"),
        ({"rows": [[1.0], ["x"]]}, r"^Sample\.rows\[1\]\[0\]: expected float, got str 'x'$"),
        ({"by_node": {"zero": 1}}, r"^Sample\.by_node: key 'zero' is not an integer$"),
        ({"by_node": {"0": "1"}}, r"^Sample\.by_node\['0'\]: expected int, got str '1'$"),
        ({"where": [1]}, r"^Sample\.where: expected a JSON object, got list"),
        ({"where": {"y": 1.0}}, r"^Sample\.where: missing field 'x'$"),
        ({"where": {"x": 1, "z": 0}}, r"^Sample\.where: unknown field\(s\) 'z'$"),
        ({"points": [{"x": 1}, {"x": "2"}]}, r"^Sample\.points\[1\]\.x: expected int, got str '2'$"),
        ({"optional_point": {"x": None}}, r"^Sample\.optional_point\.x: expected int, got NoneType None$"),
        ({"seconds": "fast"}, r"^Sample\.seconds: expected float, got str 'fast'$"),
        ({"count": -1}, r"^Sample: count must be >= 0, got -1$"),
        ({"surprise": 1}, r"^Sample: unknown field\(s\) 'surprise'$"),
    ],
)
def test_a_wrong_value_names_the_record_and_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(RecordError, match=message):
        Sample.from_json(json.dumps({**good(), **change}))


@pytest.mark.parametrize("name", ["count", "where", "seconds"])
def test_a_missing_required_field_names_it(name: str) -> None:
    data = good()
    del data[name]
    with pytest.raises(RecordError, match=rf"^Sample: missing field '{name}'$"):
        Sample.from_json(json.dumps(data))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", r"^Sample: not valid JSON: "),
        (b"\xff", r"^Sample: not valid JSON: "),
        ("[1, 2]", r"^Sample: expected a JSON object, got list$"),
        ("null", r"^Sample: expected a JSON object, got NoneType$"),
    ],
)
def test_not_a_json_object(text: str | bytes, message: str) -> None:
    with pytest.raises(RecordError, match=message):
        Sample.from_json(text)


def test_record_error_is_a_value_error() -> None:
    """Readers that skip a bad record catch ValueError (e.g. a torn step-log line)."""
    assert issubclass(RecordError, ValueError)


def test_an_unsupported_field_type_is_a_programming_error() -> None:
    @dataclass(frozen=True, kw_only=True)
    class Odd(JsonRecord):
        when: complex

    with pytest.raises(TypeError, match="cannot hold a field of type"):
        Odd.from_json('{"when": 1}')
    with pytest.raises(TypeError, match="cannot write a complex"):
        Odd(when=1j).to_json()
