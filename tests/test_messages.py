"""Typed wire messages (plexus.p2p.messages): what each hint accepts, what it turns values into, and
the exact error text, field path included, for what it refuses."""

from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest

from plexus.p2p.messages import MAX_MESSAGE_BYTES, Message, MessageError

pytestmark = pytest.mark.timeout(10)


@dataclass(frozen=True)
class Inner(Message):
    a: int
    b: str | None = None

    def __post_init__(self) -> None:
        if self.a < 0:
            raise ValueError("a must be >= 0")


@dataclass(frozen=True)
class Outer(Message):
    flag: bool
    ratio: float
    name: str
    blob: bytes
    inners: tuple[Inner, ...]
    pair: tuple[int, str]
    table: dict[str, list[int]]
    anything: Any
    maybe: Inner | None = None
    numbers: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Unions(Message):
    int_first: int | float
    float_first: float | int
    either: int | str | None = None


@dataclass(frozen=True)
class Node(Message):
    value: int
    children: tuple["Node", ...] = ()


def outer(**changes) -> list:
    """A valid Outer as msgpack would decode it, with some fields replaced."""
    fields = dict(
        flag=True,
        ratio=0.5,
        name="n",
        blob=b"b",
        inners=[[1, "x"], [2]],
        pair=[1, "p"],
        table={"k": [1, 2]},
        anything={"free": [None]},
        maybe=None,
        numbers=[3],
    )
    fields.update(changes)
    return list(fields.values())


def decode(cls, raw):
    return cls.decode(msgpack.packb(raw, use_bin_type=True))


def test_round_trip_gives_the_declared_types():
    message = Outer(
        False,
        2.5,
        "name",
        b"\x00",
        (Inner(1, "x"), Inner(0)),
        (7, "seven"),
        {"k": [1]},
        [1, {"x": b"y"}],
        Inner(3),
        [4, 5],
    )
    assert Outer.decode(message.encode()) == message
    got = decode(Outer, outer(ratio=1))
    assert got.ratio == 1.0 and type(got.ratio) is float  # an int is a valid float...
    assert got.inners == (Inner(1, "x"), Inner(2)) and got.pair == (1, "p")  # ...and arrays become tuples
    assert got.numbers == [3] and type(got.numbers) is list


def test_trailing_fields_with_defaults_may_be_missing_and_no_more_fields_may_come():
    assert decode(Outer, outer()[:8]) == decode(Outer, outer(maybe=None, numbers=[]))
    with pytest.raises(MessageError, match=r"^Outer: expected 10 fields of Outer$"):
        decode(Outer, outer()[:7])
    with pytest.raises(MessageError, match=r"^Outer: expected 10 fields of Outer$"):
        decode(Outer, outer() + [0])
    with pytest.raises(MessageError, match=r"^Outer: expected 10 fields of Outer$"):
        decode(Outer, {"flag": True})


@pytest.mark.parametrize(
    "changes, error",
    [
        (dict(flag=1), "Outer.flag: expected bool, got int"),
        (dict(ratio=True), "Outer.ratio: expected float, got bool"),
        (dict(name=b"n"), "Outer.name: expected str, got bytes"),
        (dict(inners=[[1], [True]]), "Outer.inners[1].a: expected int, got bool"),
        (dict(inners=[[1], [-1]]), "Outer.inners[1]: a must be >= 0"),
        (dict(inners=[[1], [1, 2]]), "Outer.inners[1].b: expected str, got int"),
        (dict(inners=[[1, "x", 3]]), "Outer.inners[0]: expected 2 fields of Inner"),
        (dict(inners={"a": 1}), "Outer.inners: expected a list, got dict"),
        (dict(pair=[1, "p", 2]), "Outer.pair: expected 2 items, got 3"),
        (dict(pair=[1, 2]), "Outer.pair[1]: expected str, got int"),
        (dict(table=[1]), "Outer.table: expected a map, got list"),
        (dict(table={1: [1]}), "Outer.table key: expected str, got int"),
        (dict(table={"k": [1, "2"]}), "Outer.table['k'][1]: expected int, got str"),
        (dict(maybe=[False]), "Outer.maybe.a: expected int, got bool"),  # X | None reports X's own error
        (dict(numbers=[1, None]), "Outer.numbers[1]: expected int, got NoneType"),
    ],
)
def test_errors_name_the_field_and_the_problem(changes, error):
    with pytest.raises(MessageError) as caught:
        decode(Outer, outer(**changes))
    assert str(caught.value) == error


def test_unions_try_their_options_in_order():
    first = decode(Unions, [1, 1])
    assert (first.int_first, type(first.int_first)) == (1, int)
    assert (first.float_first, type(first.float_first)) == (1.0, float)
    assert decode(Unions, [1, 1, "s"]).either == "s" and decode(Unions, [1, 1, None]).either is None
    with pytest.raises(MessageError) as caught:
        decode(Unions, [None, 1])  # None only where the union allows it
    assert str(caught.value) == "Unions.int_first: matches none of int | float"
    with pytest.raises(MessageError) as caught:
        decode(Unions, [1, 1, b"s"])
    assert str(caught.value) == "Unions.either: matches none of int | str | None"


def test_a_message_may_contain_itself():
    tree = Node(1, (Node(2), Node(3, (Node(4),))))
    assert Node.decode(tree.encode()) == tree
    with pytest.raises(MessageError) as caught:
        decode(Node, [1, [[2, []], [3, [[4, ["x"]]]]]])
    assert str(caught.value) == "Node.children[1].children[0].children[0]: expected 2 fields of Node"


def test_malformed_and_oversized_bytes():
    with pytest.raises(MessageError, match="^Inner is not valid msgpack"):
        Inner.decode(b"\xc1")
    too_big = MAX_MESSAGE_BYTES + 1
    with pytest.raises(MessageError, match=f"^Inner of {too_big} bytes exceeds {MAX_MESSAGE_BYTES}$"):
        Inner.decode(b"\x00" * too_big)


def test_encode_packs_fields_in_declaration_order():
    assert Inner(1, "x").encode() == msgpack.packb([1, "x"], use_bin_type=True)
    assert Node(1, (Node(2),)).encode() == msgpack.packb([1, [[2, []]]], use_bin_type=True)
