"""What one DHT node holds: records keyed by DHTID, each a value or a dictionary of sub-values.

Rules (hivemind reference, section 3, "Value semantics"):
- a record is (key, value, expiration_time); a store is accepted only with a strictly later
  expiration than what is held, and never when already expired; expired records vanish;
- `store_subkey` adds or updates one entry of a dictionary value, each entry with its own
  expiration; the dictionary as a whole expires with its latest entry;
- a plain value with a later expiration replaces a dictionary, and a sub-key store with a later
  expiration replaces a plain value (the dictionary starts afresh).
Values are kept as the serialized bytes that arrived; this module never deserializes them.
The same class, with a `maxsize`, is the node's cache of values found elsewhere.
"""

from ..utils.timed_storage import TimedStorage, ValueWithExpiration
from .routing import DHTID

BinaryValue = bytes
Subkey = bytes  # msgpack of the user's subkey


class DictionaryDHTValue(TimedStorage[Subkey, BinaryValue]):
    """Sub-key -> (value bytes, expiration); remembers its latest expiration for the outer record."""

    def __init__(self, maxsize: int | None = None):
        super().__init__(maxsize)
        self.latest_expiration_time = float("-inf")

    def store(self, key: Subkey, value: BinaryValue, expiration_time: float, now: float) -> bool:
        stored = super().store(key, value, expiration_time, now)
        if stored:
            self.latest_expiration_time = max(self.latest_expiration_time, expiration_time)
        return stored

    def __eq__(self, other) -> bool:
        return isinstance(other, DictionaryDHTValue) and self.data == other.data

    __hash__ = None


StoredValue = BinaryValue | DictionaryDHTValue


class DHTLocalStorage(TimedStorage[DHTID, StoredValue]):
    """Records this node is responsible for (or, with `maxsize`, has cached)."""

    def store(
        self, key: DHTID, value: BinaryValue, expiration_time: float, now: float, subkey: Subkey | None = None
    ) -> bool:
        if subkey is None:
            return super().store(key, value, expiration_time, now)
        return self.store_subkey(key, subkey, value, expiration_time, now)

    def store_subkey(
        self, key: DHTID, subkey: Subkey, value: BinaryValue, expiration_time: float, now: float
    ) -> bool:
        """Add or update one dictionary entry; fails if a plain value with a later expiration is held."""
        current = self.get(key, now)
        if expiration_time <= now:
            return False
        if current is None or (
            not isinstance(current.value, DictionaryDHTValue) and current.expiration_time < expiration_time
        ):
            dictionary = DictionaryDHTValue()
            dictionary.store(subkey, value, expiration_time, now)
            return super().store(key, dictionary, expiration_time, now)
        if not isinstance(current.value, DictionaryDHTValue):
            return False
        if not current.value.store(subkey, value, expiration_time, now):
            return False
        if expiration_time > current.expiration_time:
            super().store(key, current.value, expiration_time, now)
        return True

    def store_dictionary(
        self, key: DHTID, entries: list[tuple[Subkey, BinaryValue, float]], now: float
    ) -> list[bool]:
        """Merge many entries of one dictionary (as found elsewhere or handed over), entry by entry."""
        return [self.store_subkey(key, subkey, value, expiration, now) for subkey, value, expiration in entries]


__all__ = ["BinaryValue", "DHTLocalStorage", "DictionaryDHTValue", "StoredValue", "Subkey", "ValueWithExpiration"]
