"""What one DHT node holds: records keyed by DHTID, each a value or a dictionary of sub-values.

Rules (hivemind reference, section 3, "Value semantics"):
- a record is (key, value, expiration_time); a store is accepted only with a strictly later
  expiration than what is held, and never when already expired; expired records vanish;
- `store_subkey` adds or updates one entry of a dictionary value, each entry with its own
  expiration; the dictionary as a whole expires with its latest entry;
- a plain value with a later expiration replaces a dictionary, and a sub-key store with a later
  expiration replaces a plain value (the dictionary starts afresh);
- except for signed entries: a plain value never replaces a dictionary that holds an *owned*
  entry (a sub-key naming `[owner:<key>]`, see crypto.py), and an owned entry replaces a plain
  value whatever its expiration. An unsigned value must not erase or shadow what owners signed.
Values are kept as the serialized bytes that arrived; this module never deserializes them.
The same class, with a `maxsize`, is the node's cache of values found elsewhere.

Limits. A node's storage and cache are given `StorageLimits`; the buffers that merge what a
lookup found are not. Every record or entry is booked to its *sender* (the peer that stored it
here; None for this node itself): a sender may hold `max_records_per_sender` records and
`max_bytes_per_sender` bytes, and the node `max_bytes` in all. Past the total, the sender that
holds the most bytes loses its oldest record, or, when that is the sender of the new record, the
new record is refused: no sender can push others out by storing more. Within one dictionary each
entry belongs to an *account*: its owner when the sub-key names one, else its sender. An owner
keeps at most `max_subkeys_per_owner` entries in a key (a newer one replaces its older), a sender
at most `max_subkeys_per_sender` unowned ones, and a full dictionary (`max_entries_per_key`) makes
room by dropping an entry of its largest account, so a stuffed key still takes honest entries.
Readers get at most `max_reply_entries`/`max_reply_bytes` of a dictionary, taken round-robin
across accounts (`fair_items`), so an honest entry never falls out of what they see. Every refusal
is logged once per sender and reason (rate-limited), with the sender's peer id.
"""

import dataclasses
import itertools
import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from ..p2p.identity import PeerID
from ..utils.logging import RateLimitedLog
from ..utils.timed_storage import TimedStorage, ValueWithExpiration
from .crypto import OWNER_PATTERN
from .routing import DHTID

logger = logging.getLogger(__name__)
_REFUSALS = RateLimitedLog(logger)  # shared: readers merge answers in many short-lived storages

BinaryValue = bytes
Subkey = bytes  # msgpack of the user's subkey
Sender = bytes | None  # the peer id bytes of whoever stored a record here; None: this node itself
RECORD_OVERHEAD = 512  # bytes booked per record besides sub-key and value: its Python objects and bookkeeping


@dataclasses.dataclass(frozen=True)
class StorageLimits:
    """Bounds of what one DHT node stores for others (`DHTNode.create(storage_limits=...)`)."""

    max_bytes: int = 256 << 20
    """All records held (sub-keys, values and RECORD_OVERHEAD each) in the storage, and again in the
    cache; past it the heaviest sender's oldest records go first."""
    max_bytes_per_sender: int = 16 << 20
    """Bytes one sending peer may hold here; stores past it are refused."""
    max_records_per_sender: int = 16384
    """Records and dictionary entries one sending peer may hold here; stores past it are refused."""
    max_entries_per_key: int = 4096
    """Entries of one dictionary value; a full one drops an entry of its largest account."""
    max_subkeys_per_owner: int = 1
    """Entries one owner (`[owner:...]` in the sub-key) may have in one key; a newer one replaces
    its older one."""
    max_subkeys_per_sender: int = 128
    """Unowned entries one sending peer may add to one key (relayed copies of others' entries count too)."""
    max_expiration: float = 86400.0
    """How far in the future an expiration may lie, in seconds; records that expire later are refused."""
    max_reply_entries: int = 4096
    """Entries of one dictionary returned to a reader, chosen round-robin across accounts."""
    max_reply_bytes: int = 1 << 20
    """Bytes of one dictionary returned to a reader, chosen likewise."""

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if not getattr(self, field.name) > 0:
                value = getattr(self, field.name)
                raise ValueError(f"StorageLimits.{field.name} must be positive, not {value}")


def owner_of(subkey: Subkey | None) -> bytes | None:
    """The owner marker a sub-key names, or None."""
    match = OWNER_PATTERN.search(subkey) if subkey else None
    return None if match is None else match.group(0)


def record_size(subkey: Subkey | None, value: BinaryValue) -> int:
    return RECORD_OVERHEAD + len(subkey or b"") + len(value)


class DictionaryDHTValue(TimedStorage[Subkey, BinaryValue]):
    """Sub-key -> (value bytes, expiration); remembers its latest expiration for the outer record,
    and who each entry belongs to (its sender, and its account: owner or sender), for the limits
    and for fair replies."""

    def __init__(self, maxsize: int | None = None):
        super().__init__(maxsize)
        self.latest_expiration_time = float("-inf")
        self.senders: dict[Subkey, Sender] = {}
        self.accounts: dict[tuple, dict[Subkey, None]] = {}  # ("owner", marker) or ("sender", sender)
        self.by_sender: dict[Sender, dict[Subkey, None]] = {}
        self.on_forget: Callable[[Subkey], None] | None = (
            None  # called with the sub-key of every entry that leaves
        )

    @staticmethod
    def account_of(subkey: Subkey, sender: Sender) -> tuple:
        owner = owner_of(subkey)
        return ("owner", owner) if owner is not None else ("sender", sender)

    def store(
        self,
        key: Subkey,
        value: BinaryValue,
        expiration_time: float,
        now: float | None = None,
        sender: Sender = None,
    ) -> bool:
        stored = super().store(key, value, expiration_time, now)
        if stored:
            self.latest_expiration_time = max(self.latest_expiration_time, expiration_time)
            self.senders[key] = sender
            self.accounts.setdefault(self.account_of(key, sender), {})[key] = None
            self.by_sender.setdefault(sender, {})[key] = None
        return stored

    def _forget(self, key: Subkey, item: ValueWithExpiration[BinaryValue]) -> None:
        sender = self.senders.pop(key, None)
        groups: dict[Any, dict[Subkey, None]]  # accounts or senders, each to the sub-keys they hold
        group: Any
        for groups, group in ((self.accounts, self.account_of(key, sender)), (self.by_sender, sender)):
            entries = groups.get(group)
            if entries is not None:
                entries.pop(key, None)
                if not entries:
                    del groups[group]
        if self.on_forget is not None:
            self.on_forget(key)

    def has_owned_entries(self, now: float) -> bool:
        self.remove_outdated(now)
        return any(kind == "owner" for kind, _ in self.accounts)

    def soonest(self, entries) -> Subkey:
        return min(entries, key=lambda subkey: self.data[subkey].expiration_time)

    def fair_items(
        self, now: float, max_entries: int, max_bytes: int
    ) -> list[tuple[Subkey, ValueWithExpiration]]:
        """At most `max_entries` entries and `max_bytes`, taken round-robin across senders and,
        within a sender, across accounts (latest-expiring first), so that nobody can crowd the
        others out of a reply however many entries they stuffed in."""
        self.remove_outdated(now)
        total = sum(record_size(subkey, item.value) for subkey, item in self.data.items())
        if len(self.data) <= max_entries and total <= max_bytes:
            return list(self.data.items())
        queues = []
        for entries in self.by_sender.values():
            ranked = defaultdict(list)
            for subkey in sorted(entries, key=lambda subkey: -self.data[subkey].expiration_time):
                ranked[self.account_of(subkey, self.senders[subkey])].append(subkey)
            rounds = itertools.zip_longest(*ranked.values())
            queues.append([subkey for round_ in rounds for subkey in round_ if subkey is not None])
        chosen: list[tuple[Subkey, ValueWithExpiration[BinaryValue]]] = []
        size = 0
        for subkey in itertools.chain.from_iterable(itertools.zip_longest(*queues)):
            if subkey is None:
                continue
            item = self.data[subkey]
            size += record_size(subkey, item.value)
            if len(chosen) >= max_entries or size > max_bytes:
                break
            chosen.append((subkey, item))
        return chosen

    def __eq__(self, other) -> bool:
        return isinstance(other, DictionaryDHTValue) and self.data == other.data

    __hash__ = None  # type: ignore[assignment]  # mutable, so unhashable (as dict is)


StoredValue = BinaryValue | DictionaryDHTValue


def _as_dictionary(
    item: ValueWithExpiration[StoredValue] | None,
) -> ValueWithExpiration[DictionaryDHTValue] | None:
    """`item` if it holds a dictionary value, else None (nothing, or a plain value)."""
    if item is None or not isinstance(item.value, DictionaryDHTValue):
        return None
    return ValueWithExpiration(item.value, item.expiration_time)


class _Ledger:
    """What each sender holds in one storage: bytes, and its records oldest first."""

    def __init__(self):
        self.total_bytes = 0
        self.bytes: dict[Sender, int] = defaultdict(int)
        self.records: dict[Sender, dict[tuple, int]] = defaultdict(dict)  # sender -> {(key, subkey): size}
        self.sender_of: dict[tuple, Sender] = {}

    def add(self, where: tuple, sender: Sender, size: int) -> None:
        self.release(where)
        self.sender_of[where] = sender
        self.records[sender][where] = size
        self.bytes[sender] += size
        self.total_bytes += size

    def release(self, where: tuple) -> None:
        if where not in self.sender_of:
            return
        sender = self.sender_of.pop(where)
        size = self.records[sender].pop(where)
        self.bytes[sender] -= size
        self.total_bytes -= size
        if not self.records[sender]:
            del self.records[sender], self.bytes[sender]

    def heaviest(self) -> Sender:
        return max(self.bytes, key=self.bytes.__getitem__)


class DHTLocalStorage(TimedStorage[DHTID, StoredValue]):
    """Records this node is responsible for (or, with `maxsize`, has cached); bounded by `limits`."""

    def __init__(self, maxsize: int | None = None, limits: StorageLimits | None = None):
        super().__init__(maxsize)
        self.limits = limits
        self._ledger = _Ledger() if limits is not None else None

    @property
    def total_bytes(self) -> int:
        """Bytes booked for what is held (0 without limits: nothing is booked then)."""
        return 0 if self._ledger is None else self._ledger.total_bytes

    def bytes_of(self, sender: Sender) -> int:
        return 0 if self._ledger is None else self._ledger.bytes.get(sender, 0)

    def store(  # type: ignore[override]  # a plain value or one entry, never a whole dictionary
        self,
        key: DHTID,
        value: BinaryValue,
        expiration_time: float,
        now: float,
        subkey: Subkey | None = None,
        sender: Sender = None,
    ) -> bool:
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time, now, sender)
        current = self.get(key, now)
        if (
            current is not None
            and isinstance(current.value, DictionaryDHTValue)
            and current.value.has_owned_entries(now)
        ):
            return self._refuse(sender, "signed entries", "a plain value cannot replace signed entries")
        if (current is not None and current.expiration_time >= expiration_time) or expiration_time <= now:
            return False
        if not self._admit(key, None, value, expiration_time, now, sender):
            return False
        if not super().store(key, value, expiration_time, now):
            return False
        self._book(key, None, value, sender)
        return True

    def store_subkey(
        self,
        key: DHTID,
        subkey: Subkey,
        value: BinaryValue,
        expiration_time: float,
        now: float,
        sender: Sender = None,
    ) -> bool:
        """Add or update one dictionary entry; fails if a plain value with a later expiration is held
        (an owned entry replaces a plain value whatever its expiration)."""
        held = self.get(key, now)
        if expiration_time <= now:
            return False
        owned = owner_of(subkey) is not None
        current = _as_dictionary(held)
        if held is not None and current is None:  # a plain value
            if not owned and held.expiration_time >= expiration_time:
                return False
        if current is not None:
            existing = current.value.get(subkey, now)
            if existing is not None and existing.expiration_time >= expiration_time:
                return False
        if not self._admit(key, subkey, value, expiration_time, now, sender):
            return False
        if current is not None:  # making room for the total may have emptied it
            current = _as_dictionary(self.data.get(key))
        if current is not None and not self._make_room_in_key(
            current.value, subkey, expiration_time, now, sender
        ):
            return False
        if current is None:
            dictionary = self._new_dictionary(key)
            dictionary.store(subkey, value, expiration_time, now, sender)
            self._put(key, ValueWithExpiration(dictionary, expiration_time))  # replaces a plain value, if any
        else:
            current.value.store(subkey, value, expiration_time, now, sender)
            if expiration_time > current.expiration_time:
                self._put(key, ValueWithExpiration(current.value, expiration_time))
        self._book(key, subkey, value, sender)
        if self.maxsize is not None:
            while len(self.data) > self.maxsize:
                self._pop_soonest()
        return key in self.data

    def store_dictionary(
        self, key: DHTID, entries: list[tuple[Subkey, BinaryValue, float]], now: float, sender: Sender = None
    ) -> list[bool]:
        """Merge many entries of one dictionary (as found elsewhere or handed over), entry by entry."""
        return [
            self.store_subkey(key, subkey, value, expiration, now, sender)
            for subkey, value, expiration in entries
        ]

    def reply_items(
        self, dictionary: DictionaryDHTValue, now: float
    ) -> list[tuple[Subkey, ValueWithExpiration]]:
        """The entries of `dictionary` a reader gets: all of them, or a fair share within the limits."""
        if self.limits is None:
            return list(dictionary.items(now))
        return dictionary.fair_items(now, self.limits.max_reply_entries, self.limits.max_reply_bytes)

    # --- limits ------------------------------------------------------------------------------------

    def _new_dictionary(self, key: DHTID) -> DictionaryDHTValue:
        dictionary = DictionaryDHTValue()
        ledger = self._ledger
        if ledger is not None:
            dictionary.on_forget = lambda subkey: ledger.release((key, subkey))
        return dictionary

    def _forget(self, key: DHTID, item: ValueWithExpiration[StoredValue]) -> None:
        if self._ledger is None:
            return
        if isinstance(item.value, DictionaryDHTValue):
            if self.data.get(key) is not None and self.data[key].value is item.value:
                return  # the same dictionary, re-put with a later expiration
            for subkey in list(item.value.senders):
                self._ledger.release((key, subkey))
        else:
            self._ledger.release((key, None))

    def _book(self, key: DHTID, subkey: Subkey | None, value: BinaryValue, sender: Sender) -> None:
        if self._ledger is not None:
            self._ledger.add((key, subkey), sender, record_size(subkey, value))

    def _refuse(self, sender: Sender, limit: str, reason: str) -> bool:
        """Log once per sender and `limit` (the limit's name), and refuse."""
        who = describe_sender(sender)
        _REFUSALS.warning((limit, sender), f"DHT storage refused a record from {who} ({limit}): {reason}")
        return False

    def _admit(
        self,
        key: DHTID,
        subkey: Subkey | None,
        value: BinaryValue,
        expiration_time: float,
        now: float,
        sender: Sender,
    ) -> bool:
        """Per-sender quotas, the expiration horizon and the total bound (making room if fair)."""
        limits, ledger = self.limits, self._ledger
        if limits is None or ledger is None:  # (both or neither)
            return True
        if expiration_time > now + limits.max_expiration:
            return self._refuse(
                sender,
                "max_expiration",
                f"expiration {expiration_time - now:.0f} s ahead "
                f"exceeds the horizon of {limits.max_expiration:.0f} s",
            )
        size = record_size(subkey, value)
        replaced = ledger.records.get(sender, {}).get((key, subkey), 0)
        if sender is not None:
            held = len(ledger.records.get(sender, ())) - (1 if replaced else 0)
            if held >= limits.max_records_per_sender:
                return self._refuse(
                    sender,
                    "max_records_per_sender",
                    f"it holds {limits.max_records_per_sender} records here already",
                )
            if ledger.bytes.get(sender, 0) - replaced + size > limits.max_bytes_per_sender:
                return self._refuse(
                    sender,
                    "max_bytes_per_sender",
                    f"it would hold over {limits.max_bytes_per_sender} bytes here",
                )
        while ledger.total_bytes - replaced + size > limits.max_bytes:
            heaviest = ledger.heaviest()
            if heaviest == sender or ledger.bytes[heaviest] <= ledger.bytes.get(sender, 0) + size:
                return self._refuse(
                    sender, "max_bytes", f"the node holds {limits.max_bytes} bytes, and this sender the most"
                )
            self._evict(*next(iter(ledger.records[heaviest])))
        return True

    def _evict(self, key: DHTID, subkey: Subkey | None) -> None:
        held = self.data.get(key)
        if subkey is None:
            self.remove(key)
        elif held is not None and isinstance(held.value, DictionaryDHTValue):
            held.value.remove(subkey)
            if len(held.value) == 0:
                self.remove(key)
        if self._ledger is not None:  # whatever happened above, this booking is gone
            self._ledger.release((key, subkey))

    def _make_room_in_key(
        self,
        dictionary: DictionaryDHTValue,
        subkey: Subkey,
        expiration_time: float,
        now: float,
        sender: Sender,
    ) -> bool:
        """Per-key rules for a new or updated entry: one owner's entries, one sender's, a full key."""
        limits = self.limits
        if limits is None or subkey in dictionary:
            return True
        dictionary.remove_outdated(now)
        account = dictionary.account_of(subkey, sender)
        mine = dictionary.accounts.get(account, {})
        if account[0] == "owner" and len(mine) >= limits.max_subkeys_per_owner:
            oldest = dictionary.soonest(mine)
            if dictionary.data[oldest].expiration_time >= expiration_time:
                return self._refuse(
                    sender,
                    "max_subkeys_per_owner",
                    f"owner {account[1][:24]!r}... has {len(mine)} newer entries in this key",
                )
            dictionary.remove(oldest)
            return True
        if account[0] == "sender" and sender is not None and len(mine) >= limits.max_subkeys_per_sender:
            return self._refuse(
                sender,
                "max_subkeys_per_sender",
                f"it added {limits.max_subkeys_per_sender} entries to one key",
            )
        if len(dictionary) >= limits.max_entries_per_key:
            # drop from the largest group, by account or by sender (a Sybil's many owners share a sender)
            groups = [*dictionary.accounts.values(), *dictionary.by_sender.values()]
            largest = max(groups, key=len)
            own = max(len(mine), len(dictionary.by_sender.get(sender, ())))
            if len(largest) <= own + 1:
                return self._refuse(
                    sender,
                    "max_entries_per_key",
                    f"the key holds {limits.max_entries_per_key} entries, and this sender "
                    f"or account holds the most",
                )
            dictionary.remove(dictionary.soonest(largest))
        return True


def describe_sender(sender: Sender) -> str:
    """A sender as a log line names it: its peer id (or "this node")."""
    if sender is None:
        return "this node"
    try:
        return str(PeerID(sender))
    except ValueError:
        return repr(sender[:64])


__all__ = [
    "BinaryValue",
    "DHTLocalStorage",
    "DictionaryDHTValue",
    "Sender",
    "StorageLimits",
    "StoredValue",
    "Subkey",
    "ValueWithExpiration",
    "describe_sender",
    "owner_of",
]
