"""Record semantics: later expiration wins, expired records vanish, dictionary values per subkey."""

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
