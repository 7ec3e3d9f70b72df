"""Moving records between their forms: found on the wire, held in storage, sent, handed to the user.

`merge_found` folds a record from anywhere (a peer's answer, our storage or cache) into a storage
with the usual rules, so merging dictionary entries found on different peers is just storing them.
`unpack_found` strips validator proofs and deserializes, dropping entries that do not unpack.
"""

import logging
from typing import Any

from ..utils.serializer import MSGPackSerializer, SerializationError
from ..utils.timed_storage import ValueWithExpiration
from .messages import FindResult, StoreItem
from .routing import DHTID
from .storage import DHTLocalStorage, DictionaryDHTValue, Sender
from .validation import DHTRecord, RecordValidatorBase

logger = logging.getLogger(__name__)
PLAIN_VALUE_SUBKEY = b"\xc0"  # msgpack(None): the subkey of a record that is not a dictionary entry


def make_record(key: DHTID, subkey: bytes | None, value: bytes, expiration_time: float) -> DHTRecord:
    """The form validators see: the key as its 20 id bytes, the subkey as msgpack (of None if plain)."""
    return DHTRecord(key.to_bytes(), PLAIN_VALUE_SUBKEY if subkey is None else subkey, value, expiration_time)


def merge_found(
    target: DHTLocalStorage,
    key_id: DHTID,
    found: FindResult | ValueWithExpiration,
    now: float,
    sender: Sender = None,
) -> None:
    """`sender`: the peer whose answer `found` is; entries merged from a storage keep their own."""
    if isinstance(found, FindResult):
        if found.entries is not None:
            target.store_dictionary(key_id, list(found.entries), now, sender)
        elif found.value is not None:
            target.store(key_id, found.value, found.expiration_time, now, sender=sender)
    elif isinstance(found.value, DictionaryDHTValue):
        for subkey, item in found.value.items(now):
            target.store_subkey(
                key_id, subkey, item.value, item.expiration_time, now, found.value.senders.get(subkey, sender)
            )
    else:
        target.store(key_id, found.value, found.expiration_time, now, sender=sender)


def store_items_of(key_id: DHTID, found: ValueWithExpiration, now: float, in_cache: bool) -> list[StoreItem]:
    """The store requests that recreate `found` elsewhere (one item per dictionary entry)."""
    if isinstance(found.value, DictionaryDHTValue):
        return [
            StoreItem(key_id, subkey, item.value, item.expiration_time, in_cache)
            for subkey, item in found.value.items(now)
        ]
    return [StoreItem(key_id, None, found.value, found.expiration_time, in_cache)]


def _unpack(validator, key_id: DHTID, subkey: bytes | None, value: bytes, expiration_time: float) -> Any:
    if validator is not None:
        value = validator.strip_value(make_record(key_id, subkey, value, expiration_time))
    return MSGPackSerializer.loads(value)


def unpack_found(
    key_id: DHTID, found: ValueWithExpiration | None, validator: RecordValidatorBase | None, now: float
) -> ValueWithExpiration | None:
    """The user's view: a plain value, or {subkey: ValueWithExpiration} for a dictionary."""
    if found is None:
        return None
    if not isinstance(found.value, DictionaryDHTValue):
        try:
            return ValueWithExpiration(
                _unpack(validator, key_id, None, found.value, found.expiration_time), found.expiration_time
            )
        except (SerializationError, TypeError) as error:
            logger.debug(f"dropping a value of {key_id!r} that does not unpack: {error}")
            return None
    entries = {}
    for subkey, item in found.value.items(now):
        try:
            value = _unpack(validator, key_id, subkey, item.value, item.expiration_time)
            entries[MSGPackSerializer.loads(subkey)] = ValueWithExpiration(value, item.expiration_time)
        except (SerializationError, TypeError) as error:  # TypeError: an unhashable subkey
            logger.debug(f"dropping an entry of {key_id!r} that does not unpack: {error}")
    return ValueWithExpiration(entries, found.expiration_time) if entries else None
