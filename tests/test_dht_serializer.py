"""MSGPackSerializer (tuples survive, garbage is refused) and TimedStorage (expiry, size cap)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plexus.utils.serializer import MSGPackSerializer, SerializationError
from plexus.utils.timed_storage import TimedStorage, ValueWithExpiration
from plexus.utils.timing import ManualClock, get_dht_time, use_clock

pytestmark = pytest.mark.timeout(30)

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary(),
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=20,
)


@given(values)
@settings(max_examples=200, deadline=None)
def test_round_trip_keeps_tuples_and_lists_apart(value):
    assert MSGPackSerializer.loads(MSGPackSerializer.dumps(value)) == value
    assert repr(MSGPackSerializer.loads(MSGPackSerializer.dumps(value))) == repr(value)


def test_tuple_keys_and_nesting():
    value = {(1, "a"): ((1, 2), [3, (4,)]), "x": ()}
    restored = MSGPackSerializer.loads(MSGPackSerializer.dumps(value))
    assert restored == value and isinstance(restored["x"], tuple) and isinstance(restored[(1, "a")][1], list)


@given(st.binary(max_size=64))
@settings(max_examples=300, deadline=None)
def test_any_bytes_parse_or_raise_serialization_error(data):
    try:
        MSGPackSerializer.loads(data)
    except SerializationError:
        pass


@pytest.mark.parametrize(
    "data",
    [b"\xc1", b"\x92\x01", b"\x01\x02", b"\x81\x90\x01", b"\xd4\x41\x00", b"\xd4\x40\x01", "text", None],
)
def test_malformed_input_is_refused(data):
    with pytest.raises(SerializationError):
        MSGPackSerializer.loads(data)


def test_bounds():
    def nested_tuples(depth: int) -> bytes:
        data = MSGPackSerializer.dumps(1)
        for _ in range(depth):
            payload = b"\x91" + data  # a one-item array holding the tuple below
            data = b"\xc7" + bytes([len(payload)]) + b"\x40" + payload
        return data

    expected = 1
    for _ in range(30):
        expected = (expected,)
    assert MSGPackSerializer.loads(nested_tuples(30)) == expected
    with pytest.raises(SerializationError, match="nested deeper"):
        MSGPackSerializer.loads(nested_tuples(40))
    with pytest.raises(SerializationError):
        MSGPackSerializer.loads(b"\xc0" * 100, max_size=10)
    with pytest.raises(SerializationError, match="set"):
        MSGPackSerializer.dumps({1, 2})


def test_timed_storage_expiry_and_later_wins():
    storage = TimedStorage()
    assert storage.store("k", 1, expiration_time=10, now=0)
    assert not storage.store("k", 2, expiration_time=10, now=0)  # not strictly later
    assert not storage.store("k", 2, expiration_time=5, now=0)
    assert storage.store("k", 3, expiration_time=11, now=0)
    assert storage.get("k", now=10.5) == ValueWithExpiration(3, 11)
    assert storage.get("k", now=11) is None and len(storage) == 0
    assert not storage.store("late", 1, expiration_time=5, now=6)


def test_timed_storage_maxsize_evicts_soonest_expiring():
    storage = TimedStorage(maxsize=2)
    storage.store("a", 1, 30, now=0)
    storage.store("b", 1, 10, now=0)
    storage.store("c", 1, 20, now=0)
    assert set(dict(storage.items(now=0))) == {"a", "c"}
    assert storage.top(now=0)[0] == "c"
    for i in range(1000):  # the lazy heap stays proportional to the live size
        storage.store("a", i, 31 + i, now=0)
    assert len(storage._heap) < 2 * len(storage) + 20


def test_manual_clock():
    clock = ManualClock(start=100.0)
    with use_clock(clock):
        assert get_dht_time() == 100.0
        clock.advance(5)
        assert get_dht_time() == 105.0
    assert get_dht_time() > 1e9
