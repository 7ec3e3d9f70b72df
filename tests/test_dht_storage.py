"""Record semantics: later expiration wins, expired records vanish, dictionary values per subkey."""

import tracemalloc

import pytest

from plexus.dht.routing import DHTID
from plexus.dht.storage import DHTLocalStorage, DictionaryDHTValue

pytestmark = pytest.mark.timeout(30)
KEY = DHTID.generate("key")


def test_plain_values():
    storage = DHTLocalStorage()
    assert storage.store(KEY, b"v1", 10, now=0)
    assert not storage.store(KEY, b"old", 9, now=0)
    assert storage.store(KEY, b"v2", 12, now=0)
    assert storage.get(KEY, now=1) == (b"v2", 12)
    assert storage.get(KEY, now=12) is None
    assert not storage.store(KEY, b"expired", 5, now=6)


def test_dictionary_entries_have_their_own_expiration():
    storage = DHTLocalStorage()
    assert storage.store(KEY, b"a", 10, now=0, subkey=b"s1")
    assert storage.store(KEY, b"b", 20, now=0, subkey=b"s2")
    assert not storage.store(KEY, b"a-old", 9, now=0, subkey=b"s1")
    assert storage.store(KEY, b"a-new", 15, now=0, subkey=b"s1")
    value, expiration = storage.get(KEY, now=1)
    assert isinstance(value, DictionaryDHTValue) and expiration == 20
    assert dict(value.items(now=1)) == {b"s1": (b"a-new", 15), b"s2": (b"b", 20)}
    assert dict(storage.get(KEY, now=16).value.items(now=16)) == {b"s2": (b"b", 20)}
    assert storage.get(KEY, now=20) is None


def test_plain_value_and_dictionary_replace_each_other_by_expiration():
    storage = DHTLocalStorage()
    storage.store(KEY, b"entry", 10, now=0, subkey=b"s")
    assert not storage.store(KEY, b"plain", 10, now=0)  # not later than the dictionary's latest entry
    assert storage.store(KEY, b"plain", 11, now=0)
    assert not storage.store(KEY, b"entry2", 11, now=0, subkey=b"s")
    assert storage.store(KEY, b"entry3", 12, now=0, subkey=b"s2")  # later: a fresh dictionary
    value, expiration = storage.get(KEY, now=0)
    assert dict(value.items(now=0)) == {b"s2": (b"entry3", 12)} and expiration == 12


def test_store_dictionary_merges_entry_by_entry():
    storage = DHTLocalStorage()
    storage.store(KEY, b"x", 10, now=0, subkey=b"a")
    assert storage.store_dictionary(KEY, [(b"a", b"older", 5), (b"b", b"y", 7)], now=0) == [False, True]
    assert dict(storage.get(KEY, now=0).value.items(now=0)) == {b"a": (b"x", 10), b"b": (b"y", 7)}


def test_cache_with_maxsize():
    cache = DHTLocalStorage(maxsize=2)
    for i in range(5):
        cache.store(DHTID.generate(i), b"v", 10 + i, now=0)
    assert len(cache) == 2
    assert cache.get(DHTID.generate(4), now=0) is not None and cache.get(DHTID.generate(0), now=0) is None
    assert cache.remove(DHTID.generate(4)) and len(cache) == 1


# --- limits against a hostile storer --------------------------------------------------------------

from plexus.dht.crypto import Ed25519SignatureValidator  # noqa: E402
from plexus.dht.storage import StorageLimits  # noqa: E402

HOSTILE, HONEST = b"hostile-peer", b"honest-peer"
OWNER = Ed25519SignatureValidator().local_public_key
OTHER_OWNER = Ed25519SignatureValidator().local_public_key


def test_one_sender_storing_100k_keys_stays_bounded():
    limits = StorageLimits()
    keys = [DHTID.generate(i) for i in range(100_000)]
    tracemalloc.start()
    try:
        storage = DHTLocalStorage(limits=limits)
        accepted = sum(storage.store(key, b"x" * 16, 1000, now=0, sender=HOSTILE) for key in keys)
        held_memory = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert accepted == len(storage) == limits.max_records_per_sender
    assert storage.bytes_of(HOSTILE) == storage.total_bytes <= limits.max_bytes_per_sender
    assert held_memory <= storage.total_bytes, "what is booked covers what the records really take"
    assert storage.store(KEY, b"honest", 1000, now=0, sender=HONEST), "other senders are not affected"


def test_sender_bytes_and_expiration_horizon_are_capped():
    storage = DHTLocalStorage(limits=StorageLimits(max_bytes_per_sender=10_000, max_expiration=100))
    assert not storage.store(KEY, b"far", 101, now=0, sender=HOSTILE), "expires past the horizon"
    assert storage.store(KEY, b"near", 100, now=0, sender=HOSTILE)
    stored = [storage.store(DHTID.generate(i), b"x" * 1000, 50, now=0, sender=HOSTILE) for i in range(20)]
    assert stored.count(True) < 10 and storage.bytes_of(HOSTILE) <= 10_000


def test_total_memory_bound_evicts_the_heaviest_sender_first():
    limits = StorageLimits(max_bytes=50_000, max_bytes_per_sender=40_000)
    storage = DHTLocalStorage(limits=limits)
    assert storage.store(KEY, b"honest" * 100, 1000, now=0, sender=HONEST)
    for sender in range(5):  # several hostile senders together try to fill the node
        for i in range(100):
            key = DHTID.generate(f"{sender}-{i}")
            storage.store(key, b"x" * 1000, 1000, now=0, sender=b"sybil%d" % sender)
        assert storage.total_bytes <= limits.max_bytes
    assert storage.get(KEY, now=1).value == b"honest" * 100, "the lightest sender keeps its record"
    assert storage.store(DHTID.generate("new"), b"honest", 1000, now=1, sender=HONEST), "and may still store"


def test_one_owner_keeps_one_subkey_and_one_sender_a_bounded_number():
    storage = DHTLocalStorage(limits=StorageLimits(max_subkeys_per_sender=8))
    for i in range(100):  # [owner:ME]0, [owner:ME]1, ...: each replaces the previous
        storage.store(KEY, b"v", 100 + i, now=0, subkey=OWNER + str(i).encode(), sender=HOSTILE)
    assert list(storage.get(KEY, now=0).value.data) == [OWNER + b"99"]
    assert not storage.store(KEY, b"v", 50, now=0, subkey=OWNER + b"old", sender=HOSTILE), "older: refused"
    for i in range(100):
        storage.store(KEY, b"v", 100, now=0, subkey=b"plain%d" % i, sender=HOSTILE)
    assert len(storage.get(KEY, now=0).value) == 1 + 8


def test_subkey_stuffing_does_not_hide_an_honest_entry():
    limits = StorageLimits(max_entries_per_key=64, max_subkeys_per_sender=10**6, max_reply_bytes=4096)
    storage = DHTLocalStorage(limits=limits)
    assert storage.store(KEY, b"honest", 100, now=0, subkey=OTHER_OWNER, sender=HONEST)
    sybils = [Ed25519SignatureValidator().local_public_key for _ in range(100)]
    for i, owner in enumerate(sybils):  # many owners (keys are cheap), one sending peer, big values
        storage.store(KEY, b"x" * 200, 200 + i, now=0, subkey=owner, sender=HOSTILE)
    dictionary = storage.get(KEY, now=0).value
    assert len(dictionary) <= limits.max_entries_per_key and OTHER_OWNER in dictionary
    reply = dict(storage.reply_items(dictionary, now=0))
    assert OTHER_OWNER in reply and sum(len(k) + len(v.value) for k, v in reply.items()) <= 4096
    assert storage.store(KEY, b"late", 100, now=0, subkey=OWNER, sender=b"another-honest-peer"), (
        "a full key still takes an entry of a new sender"
    )


def test_plain_value_never_replaces_or_shadows_owned_entries():
    storage = DHTLocalStorage(limits=StorageLimits())
    assert storage.store(KEY, b"signed", 10, now=0, subkey=OWNER, sender=HONEST)
    assert not storage.store(KEY, b"{}", 10**4, now=0, sender=HOSTILE), "no plain value over signed entries"
    other = DHTID.generate("other")
    assert storage.store(other, b"{}", 10**4, now=0, sender=HOSTILE)
    assert storage.store(other, b"signed", 10, now=0, subkey=OWNER, sender=HONEST), "an owned entry wins"
    assert dict(storage.get(other, now=0).value.items(0)) == {OWNER: (b"signed", 10)}
    merged = DHTLocalStorage()  # what a reader merges from several peers follows the same rule
    merged.store(KEY, b"signed", 10, now=0, subkey=OWNER)
    assert not merged.store(KEY, b"{}", 10**4, now=0)


def test_limits_release_what_expires_or_is_replaced():
    storage = DHTLocalStorage(limits=StorageLimits(max_records_per_sender=2))
    assert storage.store(KEY, b"a", 10, now=0, sender=HOSTILE, subkey=b"s1")
    assert storage.store(KEY, b"b", 10, now=0, sender=HOSTILE, subkey=b"s2")
    assert not storage.store(DHTID.generate("x"), b"c", 10, now=0, sender=HOSTILE)
    assert storage.store(KEY, b"a2", 11, now=0, sender=HOSTILE, subkey=b"s1"), "an update is no new record"
    assert storage.store(DHTID.generate("x"), b"c", 30, now=12, sender=HOSTILE), "expired ones are released"
    assert storage.bytes_of(HOSTILE) == storage.total_bytes


def test_making_room_never_lets_a_sender_overtake_the_one_it_evicts():
    storage = DHTLocalStorage(limits=StorageLimits(max_bytes=12_000, max_bytes_per_sender=12_000))
    assert storage.store(DHTID.generate("a"), b"x" * 5000, 100, now=0, sender=b"a")
    assert storage.store(DHTID.generate("b"), b"x" * 4000, 100, now=0, sender=b"b")
    assert not storage.store(DHTID.generate("b2"), b"x" * 2000, 100, now=0, sender=b"b"), (
        "b would then hold more than a: no eviction (else the two would evict each other in turn)"
    )
    assert storage.bytes_of(b"a") > 5000 and storage.total_bytes <= 12_000


def test_refusals_are_logged_once_per_sender_and_limit(caplog):
    storage = DHTLocalStorage(limits=StorageLimits(max_records_per_sender=1))
    with caplog.at_level("WARNING", logger="plexus.dht.storage"):
        for i in range(100):
            storage.store(DHTID.generate(i), b"x", 10, now=0, sender=b"peer-logged-once")
    assert [record.getMessage().count("max_records_per_sender") for record in caplog.records] == [1]
