"""Typed wire messages: frozen dataclasses that travel as msgpack arrays and validate on receipt.

A message class declares its fields with type hints; `encode()` packs the field values in
declaration order and `decode()` checks every field against its hint before building the object,
so a handler never sees a malformed message. Supported hints: bool, int, float, str, bytes,
`X | None`, `list[X]`, `tuple[X, ...]`, `dict[K, V]`, `typing.Any` (anything msgpack can carry) and
nested Message classes. Adding a field at the end with a default keeps old senders compatible.
"""

import dataclasses
import types
import typing
from functools import cache

import msgpack

MAX_MESSAGE_BYTES = 64 << 20


class MessageError(ValueError):
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
        return _from_wire(cls, raw, cls.__name__)


def _to_wire(value):
    if isinstance(value, Message):
        return [_to_wire(getattr(value, field.name)) for field in dataclasses.fields(value)]
    if isinstance(value, (list, tuple)):
        return [_to_wire(item) for item in value]
    if isinstance(value, dict):
        return {key: _to_wire(item) for key, item in value.items()}
    return value


@cache
def _hints(cls) -> tuple:
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    required = sum(1 for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    return tuple((field.name, hints[field.name]) for field in fields), required


def _from_wire(hint, value, where: str):
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and issubclass(hint, Message):
        fields, required = _hints(hint)
        if not isinstance(value, list) or not required <= len(value) <= len(fields):
            raise MessageError(f"{where}: expected {len(fields)} fields of {hint.__name__}")
        kwargs = {name: _from_wire(field_hint, item, f"{where}.{name}")
                  for (name, field_hint), item in zip(fields, value)}
        try:
            return hint(**kwargs)
        except (TypeError, ValueError) as error:
            raise MessageError(f"{where}: {error}") from None
    if hint is typing.Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _from_wire(option, value, where)
            except MessageError as error:
                errors.append(str(error))
        raise MessageError(errors[0] if len(errors) == 1 else f"{where}: matches none of {hint}")
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise MessageError(f"{where}: expected a list, got {type(value).__name__}")
        args = typing.get_args(hint)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise MessageError(f"{where}: expected {len(args)} items, got {len(value)}")
            return tuple(_from_wire(arg, item, f"{where}[{i}]") for i, (arg, item) in enumerate(zip(args, value)))
        item_hint = args[0] if args else typing.Any
        items = [_from_wire(item_hint, item, f"{where}[{i}]") for i, item in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise MessageError(f"{where}: expected a map, got {type(value).__name__}")
        key_hint, value_hint = typing.get_args(hint) or (typing.Any, typing.Any)
        return {_from_wire(key_hint, k, f"{where} key"): _from_wire(value_hint, v, f"{where}[{k!r}]")
                for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, bool) or not isinstance(value, hint):
        raise MessageError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
    return value
