"""The dashboard's collector on hand-made progress records: what counts, what is skipped, what it shows."""

import json
import math

import pytest

from plexus.dashboard.address import parse_bind_address
from plexus.dashboard.collector import (
    NodeInfo,
    PeerSighting,
    ProgressReading,
    SwarmCollector,
    majority_epoch,
    nat_label,
    read_progress,
)
from plexus.dashboard.log_buffer import LogBuffer
from plexus.dht.crypto import owner_marker
from plexus.errors import UsageError
from plexus.optim.progress_tracker import LocalTrainingProgress, ProgressBounds
from plexus.p2p.identity import PrivateKey
from plexus.utils.timed_storage import ValueWithExpiration

pytestmark = pytest.mark.timeout(30)
NOW = 1_000_000.0
NODE = NodeInfo("12D3KooWself", ("/ip4/127.0.0.1/tcp/1",), "public", "direct", 3)


def signed_entry(key: PrivateKey, expiration: float = NOW + 60, **fields):
    """(sub-key, entry) as `dht.get(..., latest=True)` returns one peer's progress record."""
    record = dict(
        peer_id=key.peer_id.to_bytes(),
        epoch=0,
        samples_accumulated=10,
        samples_per_second=5.0,
        time=NOW - 1,
        client_mode=False,
    )
    record.update(fields)
    return owner_marker(key.public_key), ValueWithExpiration(record, expiration)


def found(*entries):
    return ValueWithExpiration(dict(entries), NOW + 60)


def read(*entries, stale_after: float = 30.0) -> ProgressReading:
    return read_progress(found(*entries), NOW, stale_after, ProgressBounds())


def test_fresh_signed_records_are_read_by_peer_id():
    keys = [PrivateKey.generate() for _ in range(2)]
    reading = read(signed_entry(keys[0]), signed_entry(keys[1], epoch=1, client_mode=True))
    assert set(reading.reports) == {str(key.peer_id) for key in keys} and reading.ignored == 0
    assert reading.reports[str(keys[1].peer_id)].client_mode


def test_bad_and_hostile_records_are_skipped_and_counted():
    honest, other = PrivateKey.generate(), PrivateKey.generate()
    subkey, entry = signed_entry(other)
    entries = [
        signed_entry(honest),
        (subkey, ValueWithExpiration(dict(entry.value, peer_id=honest.peer_id.to_bytes()), entry[1])),
        signed_entry(PrivateKey.generate(), time=NOW + 3600),  # from the future
        signed_entry(PrivateKey.generate(), time=NOW - 100),  # stale: a peer that died
        signed_entry(PrivateKey.generate(), expiration=NOW + 10_000),  # lives too long
        signed_entry(PrivateKey.generate(), samples_per_second=math.nan),
        signed_entry(PrivateKey.generate(), epoch=-1),
        signed_entry(PrivateKey.generate(), epoch="1"),  # strict types: no coercion
        signed_entry(PrivateKey.generate(), extra_field=1),
        (b"[owner:not base64!]", entry),
        (b"no owner at all", entry),
        (12345, entry),
        (b"garbage", ValueWithExpiration(b"\x00" * 1000, NOW + 60)),
        (b"not a pair", "nonsense"),
        (b"bad expiration", ValueWithExpiration(entry.value, math.inf)),
    ]
    reading = read(*entries)
    assert list(reading.reports) == [str(honest.peer_id)]
    assert reading.ignored == len(entries) - 1
    reasons = dict(reading.rejected)  # signed records that break a bound name their signer
    assert len(reasons) == 3 and "is not the key that signed it" in reasons[str(other.peer_id)]
    assert any("ahead of ours" in reason for reason in reasons.values())


def test_a_peer_that_left_is_not_a_bad_record():
    left = (owner_marker(PrivateKey.generate().public_key), ValueWithExpiration(None, NOW + 60))
    reading = read(left)
    assert reading.reports == {} and reading.ignored == 0


@pytest.mark.parametrize(
    "value", [None, ValueWithExpiration(b"plain", NOW + 60), ValueWithExpiration(7, NOW)]
)
def test_a_key_without_a_dictionary_yields_nothing(value):
    reading = read_progress(value, NOW, 30.0, ProgressBounds())
    assert reading.reports == {} and reading.ignored == (0 if value is None else 1)


def progress(epoch: int, client_mode: bool = False) -> LocalTrainingProgress:
    return LocalTrainingProgress(
        peer_id=b"x",
        epoch=epoch,
        samples_accumulated=0,
        samples_per_second=0.0,
        time=NOW,
        client_mode=client_mode,
    )


def test_the_global_epoch_is_the_majoritys_and_clients_do_not_vote():
    assert majority_epoch([]) == 0
    assert majority_epoch([progress(3), progress(2), progress(1)]) == 2
    assert majority_epoch([progress(1), progress(0)]) == 0  # half is not a majority
    assert majority_epoch([progress(0), progress(9, client_mode=True)]) == 0
    assert majority_epoch([progress(4, client_mode=True)]) == 4


def test_nat_labels():
    assert nat_label(progress(0, client_mode=True), None) == "client"
    assert nat_label(None, None) == "unknown"
    assert nat_label(None, PeerSighting("p", connected=True, relayed=True)) == "relayed"
    assert nat_label(None, PeerSighting("p", connected=True)) == "direct"
    circuit = "/ip4/1.2.3.4/tcp/1/p2p/12D3KooWrelay/p2p-circuit"
    assert nat_label(None, PeerSighting("p", addresses=(circuit,))) == "relayed"
    assert nat_label(None, PeerSighting("p", addresses=("/ip4/1.2.3.4/tcp/1",))) == "direct"


def test_state_lists_trainers_first_and_estimates_the_target_from_the_last_epoch():
    keys = [PrivateKey.generate() for _ in range(2)]
    collector = SwarmCollector("run", history=3)
    dht_only = PeerSighting("12D3KooWdhtonly", ("/ip4/10.0.0.1/tcp/5",), last_seen=NOW - 4)
    trainer = PeerSighting(str(keys[0].peer_id), ("/ip4/10.0.0.2/tcp/5",), connected=True)
    for epoch, samples in ((0, 40), (0, 90), (1, 30)):
        reading = read(*(signed_entry(k, epoch=epoch, samples_accumulated=samples, time=NOW) for k in keys))
        collector.observe(NOW, reading, [dht_only, trainer], NODE)
    collector.record_step(1, 2.5, 30.0, NOW)
    collector.record_step(1, 9.9, 30.0, NOW)  # a step seen twice is kept once
    collector.record_step(2, math.nan, 30.0, NOW)  # not finite: not drawn
    state = collector.state(NOW)
    json.dumps(state, allow_nan=False)
    swarm = state["swarm"]
    assert swarm["epoch"] == 1 and swarm["samples_accumulated"] == 60 and swarm["trainers"] == 2
    assert swarm["target_batch_size"] == 180 and swarm["target_estimated"]
    assert swarm["eta_seconds"] == pytest.approx((180 - 60) / 10.0)
    assert [row["status"] for row in state["peers"]] == ["training", "training", "known"]
    by_id = {row["peer_id"]: row for row in state["peers"]}
    assert by_id[str(keys[0].peer_id)]["addresses"] == ["/ip4/10.0.0.2/tcp/5"]
    assert by_id["12D3KooWdhtonly"]["last_seen_ago"] == pytest.approx(4.0)
    assert by_id["12D3KooWdhtonly"]["epoch"] is None
    assert [point["step"] for point in state["loss"]] == [1] and state["loss"][0]["loss"] == 2.5
    assert len(state["history"]) == 3 and len(collector.state(NOW, history=1)["history"]) == 1
    assert collector.state(NOW, history=0)["history"] == []
    assert state["node"]["peer_id"] == NODE.peer_id


def test_a_given_target_and_no_speed():
    collector = SwarmCollector("run", target_batch_size=100)
    collector.observe(NOW, read(signed_entry(PrivateKey.generate(), samples_per_second=0.0)), [], NODE)
    swarm = collector.state(NOW)["swarm"]
    assert (
        swarm["target_batch_size"] == 100 and not swarm["target_estimated"] and swarm["eta_seconds"] is None
    )


def test_claims_that_overflow_still_give_valid_json():
    collector = SwarmCollector("run", target_batch_size=100)
    huge = [signed_entry(PrivateKey.generate(), samples_per_second=1e308) for _ in range(3)]
    collector.observe(NOW, read(*huge), [], NODE)
    state = collector.state(NOW)
    json.dumps(state, allow_nan=False)
    assert state["swarm"]["samples_per_second"] is None and state["swarm"]["eta_seconds"] is None
    assert state["history"][-1]["samples_per_second"] is None and len(state["peers"]) == 3


def test_a_collector_without_a_run_shows_dht_peers():
    collector = SwarmCollector(None)
    assert collector.progress_key is None
    collector.observe(NOW, ProgressReading({}, 0), [PeerSighting("p", connected=True)], NODE)
    state = collector.state(NOW)
    assert state["peers"][0]["status"] == "connected" and state["swarm"]["dht_peers"] == 1


def test_log_buffer_keeps_the_newest_warnings_only():
    import logging

    buffer = LogBuffer(capacity=3, max_message_length=10).attach("plexus.test_dashboard")
    log = logging.getLogger("plexus.test_dashboard")
    try:
        log.info("not a warning")
        for i in range(5):
            log.warning("warning number %d of many", i)
    finally:
        buffer.detach()
    log.warning("after detach")
    records = buffer.records()
    assert [r["message"] for r in records] == ["warning nu"] * 3 and records[0]["level"] == "WARNING"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("8080", ("127.0.0.1", 8080)),
        ("0", ("127.0.0.1", 0)),
        ("0.0.0.0:9000", ("0.0.0.0", 9000)),
        ("localhost:1", ("localhost", 1)),
        ("[::1]:8080", ("::1", 8080)),
    ],
)
def test_bind_addresses(text, expected):
    assert parse_bind_address(text) == expected


@pytest.mark.parametrize(
    "text", ["", "http", "65536", "host:", ":80", "a b:80", "1.2.3.4:-1", "::1:80", "8080x"]
)
def test_bad_bind_addresses_say_what_is_expected(text):
    with pytest.raises(UsageError, match=r"PORT|port"):
        parse_bind_address(text)
