"""Schema validators: records under known keys must hold values of the declared types.

A pydantic model (v2, or v1 through `pydantic.v1` as hivemind's are) declares the DHT keys of an
application: each field `name` governs the key `name` (or `{prefix}_{name}`), and its annotation
says what values may be stored there. A plain value is checked against the field type; a sub-key
store is checked as the one-entry dictionary `{subkey: value}`, so dictionary fields
(`Dict[BytesWithPublicKey, Report]`) validate entry by entry. Checks are strict: no coercion, so
`"1"` is not an int and a list is not a tuple. Keys that no schema names pass when
`allow_extra_keys` is set. Schemas merge: after `merge_with`, a record is valid if any schema that
names its key accepts it. Each field is checked on its own, so other required fields of the model
do not get in the way. pydantic v1 has no strict mode: a v1 field accepts a value only if
validating it changes nothing (hivemind's rule; use v1's Strict* types for numbers, since 3.0 ==
3). A *protected* key, a dictionary field whose keys name an owner (`BytesWithPublicKey`,
`OwnerPublicKey`), is sub-keyed and signed: a plain value is never valid there, so nobody can
replace or shadow the owners' signed entries with one unsigned record.
"""

import functools
import sys
import typing
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import pydantic
from pydantic_core import core_schema

from ..utils.serializer import MSGPackSerializer, SerializationError
from . import crypto, rsa
from .routing import DHTID
from .validation import DHTRecord, RecordValidatorBase

PLAIN_VALUE_SUBKEY = MSGPackSerializer.dumps(None)


def _require_owner_marker(value: bytes) -> bytes:
    if not isinstance(value, bytes):
        raise TypeError(f"expected bytes, got {type(value).__name__}")
    if crypto.OWNER_PATTERN.search(value) is None and rsa.OWNER_PATTERN.search(value) is None:
        raise ValueError("must contain an [owner:<public key>] marker, e.g. the validator's local_public_key")
    return value


def _require_only_owner_marker(value: bytes) -> bytes:
    if not isinstance(value, bytes):
        raise TypeError(f"expected bytes, got {type(value).__name__}")
    if crypto.OWNER_PATTERN.fullmatch(value) is None and rsa.OWNER_PATTERN.fullmatch(value) is None:
        raise ValueError("must be exactly one [owner:<public key>] marker, the validator's local_public_key")
    return value


class BytesWithPublicKey(bytes):
    """Bytes that name an owner; as a dictionary key type it makes each entry signature-owned.

    Usable in pydantic v2 and v1 models alike."""

    _check = staticmethod(_require_owner_marker)

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(cls._check, core_schema.bytes_schema())

    @classmethod
    def __get_validators__(cls):  # pydantic.v1
        yield cls._check


class OwnerPublicKey(BytesWithPublicKey):
    """Bytes that are exactly an owner marker: as a dictionary key type, one entry per owner."""

    _check = staticmethod(_require_only_owner_marker)


def is_protected(annotation: Any) -> bool:
    """A dictionary whose keys name owners: sub-keyed and signed, so plain values are invalid."""
    if typing.get_origin(annotation) is not dict:
        return False
    key_type = typing.get_args(annotation)[0]
    return isinstance(key_type, type) and issubclass(key_type, BytesWithPublicKey)


def _accepts_v2(adapter: pydantic.TypeAdapter, value: Any) -> bool:
    try:
        adapter.validate_python(value, strict=True)
        return True
    except pydantic.ValidationError:
        return False


def _accepts_v1(field, value: Any) -> bool:
    validated, errors = field.validate(value, {}, loc=field.name)
    return errors is None and type(validated) is type(value) and validated == value


def _field_checks(schema: type[Any]) -> Iterator[tuple[str, Callable[[Any], bool], bool]]:
    """(key name, check, protected) for every field of a pydantic v2 or v1 model."""
    v1 = sys.modules.get("pydantic.v1")  # a v1 model means pydantic.v1 is imported already
    if v1 is not None and issubclass(schema, v1.BaseModel):
        for name, field in schema.__fields__.items():
            yield field.alias or name, functools.partial(_accepts_v1, field), is_protected(field.outer_type_)
        return
    for name, field in schema.model_fields.items():
        annotation: Any = field.annotation
        if field.metadata:
            arguments = (annotation, *field.metadata)
            annotation = Annotated[arguments]
        check = functools.partial(_accepts_v2, pydantic.TypeAdapter(annotation))
        yield field.alias or name, check, is_protected(field.annotation)


class SchemaValidator(RecordValidatorBase):
    """Validates records under the keys named by one or more pydantic models."""

    def __init__(self, schema: type, allow_extra_keys: bool = True, prefix: str | None = None):
        self._allow_extra_keys = allow_extra_keys
        self._fields: dict[DHTID, list[tuple[str, Callable[[Any], bool], bool]]] = {}
        for key, check, protected in _field_checks(schema):
            key = f"{prefix}_{key}" if prefix is not None else key
            self._fields.setdefault(DHTID.generate(source=key), []).append((key, check, protected))

    def validate(self, record: DHTRecord) -> bool:
        if len(record.key) != 20:
            return False
        checks = self._fields.get(DHTID.from_bytes(record.key))
        if checks is None:
            return self._allow_extra_keys
        plain = record.subkey == PLAIN_VALUE_SUBKEY
        try:
            value: Any = MSGPackSerializer.loads(record.value)
            if not plain:
                value = {MSGPackSerializer.loads(record.subkey): value}
        except (SerializationError, TypeError):
            return False  # TypeError: an unhashable subkey
        # a plain value under a protected key would replace or shadow the owners' signed entries
        return any(check(value) for _, check, protected in checks if not (plain and protected))

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, SchemaValidator):
            return False
        for key_id, checks in other._fields.items():
            self._fields.setdefault(key_id, []).extend(checks)
        self._allow_extra_keys = self._allow_extra_keys or other._allow_extra_keys
        return True

    @property
    def priority(self) -> int:
        return 0  # sees values after the signature (priority 10) has been stripped
