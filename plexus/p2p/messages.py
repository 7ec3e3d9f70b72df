"""Typed wire messages: frozen dataclasses that travel as msgpack arrays and validate on receipt.

A message class declares its fields with type hints; `encode()` packs the field values in
declaration order and `decode()` checks every field against its hint before building the object,
so a handler never sees a malformed message. Supported hints: bool, int, float, str, bytes,
`X | None` and other unions, `list[X]`, `tuple[X, ...]`, `tuple[X, Y]`, `dict[K, V]`, `typing.Any`
(anything msgpack can carry) and nested Message classes. Adding a field at the end with a default
keeps old senders compatible.

Decoding sits on the hot path (every all-reduce part has a header), so each message class compiles
its hints once into converters, functions `(value, where) -> value` that check a value and turn it
into what the field holds (a list into a tuple, an int into a float). Decoding is then msgpack, a
length check, one converter call per field and the constructor. `where` names the field for error
messages, as a string or a `(parent, template, key)` triple that is formatted only when one is raised.
"""

import dataclasses
import types
import typing
from functools import cache, partial

import msgpack

from ..errors import PeerMisbehaved

MAX_MESSAGE_BYTES = 64 << 20


class MessageError(PeerMisbehaved, ValueError):
    """The bytes are not a valid message of the expected type."""


class Message:
    """Base for wire messages; subclasses are `@dataclass(frozen=True)`."""

    def encode(self) -> bytes:
        return msgpack.packb(_to_wire(self), use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes):
        if len(data) > MAX_MESSAGE_BYTES:
            raise MessageError(f"{cls.__name__} of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
        try:
            raw = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as error:
            raise MessageError(f"{cls.__name__} is not valid msgpack: {error}") from None
        return _decode_message(cls, raw, cls.__name__)


_SCALARS = frozenset((bool, int, float, str, bytes, type(None)))  # most field values: skip the checks below


def _to_wire(value):
    if type(value) in _SCALARS:
        return value
    if isinstance(value, Message):
        fields = _field_names(type(value))  # type: ignore[arg-type]  # classes hash; mypy checks instances' __hash__
        return [_to_wire(getattr(value, name)) for name in fields]
    if isinstance(value, (list, tuple)):
        return [_to_wire(item) for item in value]
    if isinstance(value, dict):
        return {key: _to_wire(item) for key, item in value.items()}
    return value


@cache
def _field_names(cls: type) -> tuple[str, ...]:
    """Cached because `dataclasses.fields` costs more than packing a small message."""
    return tuple(field.name for field in dataclasses.fields(cls))


# --- decoding --------------------------------------------------------------------------------------


def _path(where) -> str:
    """The field that `where` names, formatted for an error message."""
    if isinstance(where, str):
        return where
    parent, template, key = where
    return _path(parent) + template.format(key)


@cache
def _fields(cls) -> tuple:
    """((name, converter) per field, number of fields without a default), compiled once per class.
    Keyed by class, not by hint: `int | float` equals `float | int`, yet they convert 1 differently."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    missing = dataclasses.MISSING
    required = sum(1 for f in fields if f.default is missing and f.default_factory is missing)
    return tuple((field.name, _compile(hints[field.name])) for field in fields), required


def _decode_message(cls, value, where):
    fields, required = _fields(cls)  # looked up per call, so that a message class may contain itself
    if not isinstance(value, list) or not required <= len(value) <= len(fields):
        raise MessageError(f"{_path(where)}: expected {len(fields)} fields of {cls.__name__}")
    kwargs = {name: convert(item, (where, ".{}", name)) for (name, convert), item in zip(fields, value)}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as error:
        raise MessageError(f"{_path(where)}: {error}") from None


def _compile(hint):
    """The converter for one type hint."""
    if isinstance(hint, type) and issubclass(hint, Message):
        return partial(_decode_message, hint)
    if hint is typing.Any:
        return _any
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return _union(hint, args)
    if origin is tuple and args and args[-1] is not Ellipsis:
        return _fixed_tuple(tuple(_compile(arg) for arg in args))
    if origin in (list, tuple):
        return _sequence(origin, _compile(args[0] if args else typing.Any))
    if origin is dict:
        key_hint, value_hint = args or (typing.Any, typing.Any)
        return _map(_compile(key_hint), _compile(value_hint))
    if hint is int:
        return _int
    if hint is float:
        return _float
    return _instance(hint)


def _any(value, where):
    return value


def _int(value, where):
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise MessageError(f"{_path(where)}: expected int, got {type(value).__name__}")


def _float(value, where):
    """Accepts ints too: a sender that passed 1 to a float field packs an int."""
    if isinstance(value, float):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    raise MessageError(f"{_path(where)}: expected float, got {type(value).__name__}")


def _instance(hint):
    def convert(value, where):
        if isinstance(value, hint):
            return value
        raise MessageError(f"{_path(where)}: expected {hint.__name__}, got {type(value).__name__}")

    return convert


def _union(hint, args):
    nullable = type(None) in args
    options = [_compile(arg) for arg in args if arg is not type(None)]
    if len(options) == 1:  # `X | None`: X's own error says more than "matches none"
        option = options[0]
        return lambda value, where: None if value is None else option(value, where)

    def convert(value, where):
        if value is None and nullable:
            return None
        for option in options:
            try:
                return option(value, where)
            except MessageError:
                pass
        raise MessageError(f"{_path(where)}: matches none of {hint}")

    return convert


def _sequence(origin, convert_item):
    def convert(value, where):
        if not isinstance(value, list):
            raise MessageError(f"{_path(where)}: expected a list, got {type(value).__name__}")
        items = [convert_item(item, (where, "[{}]", i)) for i, item in enumerate(value)]
        return items if origin is list else tuple(items)

    return convert


def _fixed_tuple(converters):
    def convert(value, where):
        if not isinstance(value, list):
            raise MessageError(f"{_path(where)}: expected a list, got {type(value).__name__}")
        if len(value) != len(converters):
            raise MessageError(f"{_path(where)}: expected {len(converters)} items, got {len(value)}")
        return tuple(
            convert_item(item, (where, "[{}]", i))
            for i, (convert_item, item) in enumerate(zip(converters, value))
        )

    return convert


def _map(convert_key, convert_value):
    def convert(value, where):
        if not isinstance(value, dict):
            raise MessageError(f"{_path(where)}: expected a map, got {type(value).__name__}")
        return {
            convert_key(k, (where, " key", None)): convert_value(v, (where, "[{!r}]", k))
            for k, v in value.items()
        }

    return convert
