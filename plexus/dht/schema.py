"""Schema validators: records under known keys must hold values of the declared types.

A pydantic v2 model declares the DHT keys of an application: each field `name` governs the key
`name` (or `{prefix}_{name}`), and its annotation says what values may be stored there. A plain
value is checked against the field type; a sub-key store is checked as the one-entry dictionary
`{subkey: value}`, so dictionary fields (`Dict[BytesWithPublicKey, Report]`) validate entry by
entry. Checks are strict: no coercion, so `"1"` is not an int and a list is not a tuple. Keys that
no schema names pass when `allow_extra_keys` is set. Schemas merge: after `merge_with`, a record is
valid if any schema that names its key accepts it. Each field is checked on its own, so other
required fields of the model do not get in the way. A *protected* key, a dictionary field whose keys
name an owner (`BytesWithPublicKey`, `OwnerPublicKey`), is sub-keyed and signed: a plain value is never
valid there, so nobody can replace or shadow the owners' signed entries with one unsigned record.
"""

import typing
from typing import Annotated, Any

import pydantic
from pydantic import AfterValidator

from ..utils.serializer import MSGPackSerializer, SerializationError
from .crypto import OWNER_PATTERN
from .routing import DHTID
from .validation import DHTRecord, RecordValidatorBase

PLAIN_VALUE_SUBKEY = MSGPackSerializer.dumps(None)


def _require_owner_marker(value: bytes) -> bytes:
    if OWNER_PATTERN.search(value) is None:
        raise ValueError("must contain an [owner:<public key>] marker, e.g. the validator's local_public_key")
    return value


def _require_only_owner_marker(value: bytes) -> bytes:
    if OWNER_PATTERN.fullmatch(value) is None:
        raise ValueError("must be exactly one [owner:<public key>] marker, the validator's local_public_key")
    return value


BytesWithPublicKey = Annotated[bytes, AfterValidator(_require_owner_marker)]
"""Bytes that name an owner; as a dictionary key type it makes each entry signature-owned."""
OwnerPublicKey = Annotated[bytes, AfterValidator(_require_only_owner_marker)]
"""Bytes that are exactly an owner marker: as a dictionary key type, one entry per owner."""
OWNER_KEY_TYPES = (BytesWithPublicKey, OwnerPublicKey)


def is_protected(annotation: Any) -> bool:
    """A dictionary whose keys name owners: sub-keyed and signed, so plain values are invalid."""
    return typing.get_origin(annotation) is dict and typing.get_args(annotation)[0] in OWNER_KEY_TYPES


class SchemaValidator(RecordValidatorBase):
    """Validates records under the keys named by one or more pydantic models."""

    def __init__(self, schema: type[pydantic.BaseModel], allow_extra_keys: bool = True, prefix: str | None = None):
        self._allow_extra_keys = allow_extra_keys
        self._fields: dict[DHTID, list[tuple[str, pydantic.TypeAdapter, bool]]] = {}
        for name, field in schema.model_fields.items():
            key = field.alias or name
            key = f"{prefix}_{key}" if prefix is not None else key
            annotation = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
            adapter = pydantic.TypeAdapter(annotation)
            self._fields.setdefault(DHTID.generate(source=key), []).append(
                (key, adapter, is_protected(field.annotation)))

    def validate(self, record: DHTRecord) -> bool:
        if len(record.key) != 20:
            return False
        adapters = self._fields.get(DHTID.from_bytes(record.key))
        if adapters is None:
            return self._allow_extra_keys
        plain = record.subkey == PLAIN_VALUE_SUBKEY
        try:
            value: Any = MSGPackSerializer.loads(record.value)
            if not plain:
                value = {MSGPackSerializer.loads(record.subkey): value}
        except (SerializationError, TypeError):
            return False  # TypeError: an unhashable subkey
        for _, adapter, protected in adapters:
            if plain and protected:
                continue  # a plain value would replace or shadow the owners' signed entries
            try:
                adapter.validate_python(value, strict=True)
                return True
            except pydantic.ValidationError:
                continue
        return False

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, SchemaValidator):
            return False
        for key_id, adapters in other._fields.items():
            self._fields.setdefault(key_id, []).extend(adapters)
        self._allow_extra_keys = self._allow_extra_keys or other._allow_extra_keys
        return True

    @property
    def priority(self) -> int:
        return 0  # sees values after the signature (priority 10) has been stripped
