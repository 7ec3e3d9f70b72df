"""A hostile donor cannot poison a newcomer's state while honest donors are around (state_vote.py):
the rule on its own, then over real hosts and DHT nodes on 127.0.0.1."""

import asyncio
import logging

import pytest
import torch

from plexus.averaging import state_download
from plexus.averaging.state_download import StateDownloadError
from plexus.averaging.state_vote import (
    MAX_LEAD,
    NORM_TOLERANCE,
    Ballot,
    Contender,
    credible_priority,
    effective_priority,
    judge,
    tally,
)
from plexus.p2p.identity import PrivateKey
from tests.test_state_transfer import assert_same, load, make_state, run, share, swarm

pytestmark = pytest.mark.timeout(60)
PEERS = [PrivateKey.generate().peer_id for _ in range(4)]


def poisoned(state, factor: float = 1000.0):
    """Same metadata, shapes and dtypes; every floating value multiplied (well-formed, finite)."""
    metadata, tensors = state
    return metadata, [t * factor if t.dtype.is_floating_point else t.clone() for t in tensors]


def nudged(state, amount: float = 1e-3):
    """An honest peer's slightly different state (e.g. after a local update)."""
    metadata, tensors = state
    return metadata, [t + amount if t.dtype.is_floating_point else t.clone() for t in tensors]


# --- the rule, no I/O ------------------------------------------------------------------------------


def test_a_lone_priority_ahead_of_the_others_is_not_credible():
    assert credible_priority([5, 5, 100], None) == 5
    assert credible_priority([100], None) == 100, "a single donor: nothing to compare with"
    assert credible_priority([5, 5, 100], 7) == 7, "the progress records' epoch raises it"
    assert effective_priority(5 + MAX_LEAD, 5) == 5 + MAX_LEAD, "one step of lag is believed"
    assert effective_priority(100, 5) == 5


def test_tally_majority_tier_and_outvoted():
    a, b, c, d = PEERS
    votes = tally([Ballot(a, 5, b"honest"), Ballot(b, 5, b"honest"), Ballot(c, 100, b"evil")])
    assert votes.credible == 5 and votes.majority == b"honest" and votes.outvoted(b"honest") == [c]
    split = tally([Ballot(a, 5, b"x"), Ballot(b, 5, b"y")])
    assert split.majority is None and set(split.keys) == {b"x", b"y"}
    older = tally([Ballot(a, 6, b"x"), Ballot(b, 6, b"x"), Ballot(c, 5, b"y"), Ballot(d, 5, b"y")])
    assert len(older.tier) == 2 and older.majority == b"x", "donors below P do not vote"
    assert tally([Ballot(a, 3, b"x")], min_priority=4).tier == ()


def contender(key: bytes, peers, priority: float, tensors) -> Contender:
    return Contender(key, priority, list(peers), tensors)


def test_judge_refuses_a_blown_up_state_and_picks_the_one_closest_to_the_others():
    a, b, c, _ = PEERS
    honest = [torch.ones(10), torch.full((3,), 2.0)]
    close = [t + 0.01 for t in honest]
    far = [-t for t in honest]  # same norm as honest, but far from both honest states
    winner, reasons = judge(
        [contender(b"far", [c], 5, far), contender(b"h1", [a], 5, honest), contender(b"h2", [b], 5, close)], 5
    )
    assert winner.key in (b"h1", b"h2") and "closer to the other candidates" in reasons[b"far"]
    blown = [t * (NORM_TOLERANCE + 1) for t in honest]
    winner, reasons = judge([contender(b"big", [c], 5, blown), contender(b"h1", [a], 5, honest)], 5)
    assert winner.key == b"h1" and "exceeds" in reasons[b"big"]


def test_judge_one_against_one_newer_within_a_step_then_smaller_norm():
    a, b, _, _ = PEERS
    state, larger = [torch.ones(10)], [torch.full((10,), 1.5)]
    assert judge([contender(b"l", [a], 5, larger), contender(b"s", [b], 5, state)], 5)[0].key == b"s"
    newer = judge([contender(b"l", [a], 6, larger), contender(b"s", [b], 5, state)], 5)[0]
    assert newer.key == b"l", "within MAX_LEAD of the credible priority, the newer state wins"
    far_ahead = judge([contender(b"l", [a], 50, larger), contender(b"s", [b], 5, state)], 5)[0]
    assert far_ahead.key == b"s", "a priority far ahead gives no preference"


def hear_the_hostile_one_first(monkeypatch, hostile) -> None:
    """Honest manifests reach the newcomer only after the hostile one has: two agreeing honest
    manifests settle the vote at once, and the test is about a hostile donor that was heard."""
    fetch, heard = state_download._Download.fetch_manifest, asyncio.Event()

    async def ordered(self, donor):
        result = await fetch(self, donor)
        if donor.peer_id == hostile:
            heard.set()
        else:
            await asyncio.wait_for(heard.wait(), 10)
        return result

    monkeypatch.setattr(state_download._Download, "fetch_manifest", ordered)


# --- over the network ------------------------------------------------------------------------------


@pytest.mark.parametrize("hostile_priority", [3, 4, 1000], ids=["same", "one_ahead", "far_ahead"])
def test_two_agreeing_honest_donors_outvote_a_poisoned_one(hostile_priority, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="plexus")

    async def main():
        async with swarm(4) as (h1, h2, evil, newcomer):
            hear_the_hostile_one_first(monkeypatch, evil.host.peer_id)
            state = make_state()
            honest = [await share(peer, state, priority=3) for peer in (h1, h2)]
            hostile = await share(evil, poisoned(state), priority=hostile_priority)
            metadata, loaded = await load(newcomer, min_priority=3)
            assert metadata == state[0]
            assert_same(state[1], loaded)
            # it may still have served chunks its state shares with the honest one (zeros, integers):
            # they are fetched by hash, so they are the honest bytes
            outvoted = [r.getMessage() for r in caplog.records if "outvoted" in r.getMessage()]
            assert any(str(evil.host.peer_id) in message for message in outvoted), outvoted
            for sharing in (*honest, hostile):
                await sharing.shutdown()

    run(main())


def test_disagreeing_honest_donors_still_beat_a_blown_up_one(caplog):
    caplog.set_level(logging.WARNING, logger="plexus")

    async def main():
        async with swarm(4) as (h1, h2, evil, newcomer):
            state, other = make_state(), nudged(make_state())
            first, second = await share(h1, state, priority=3), await share(h2, other, priority=3)
            hostile = await share(evil, poisoned(state, 10.0), priority=1000)
            _, loaded = await load(newcomer)
            assert any(torch.equal(loaded[0], candidate[1][0]) for candidate in (state, other))
            refused = [r.getMessage() for r in caplog.records if str(evil.host.peer_id) in r.getMessage()]
            assert refused and "exceeds" in refused[0], refused
            for sharing in (first, second, hostile):
                await sharing.shutdown()

    run(main())


def test_one_honest_against_one_hostile_at_the_same_priority_follows_the_fallback_rule(caplog):
    """Nothing to compare with: a blown-up state is refused (norm above NORM_TOLERANCE x the lower
    median), and of two plausible states the smaller norm wins; the loser is named."""
    caplog.set_level(logging.WARNING, logger="plexus")

    async def main():
        async with swarm(3) as (good, evil, newcomer):
            state = make_state()
            honest = await share(good, state, priority=3)
            hostile = await share(evil, poisoned(state, NORM_TOLERANCE * 2), priority=3)
            _, loaded = await load(newcomer)
            assert_same(state[1], loaded)
            await hostile.shutdown()
            hostile = await share(evil, poisoned(state, 1.5), priority=3)  # within the tolerance, larger
            _, loaded = await load(newcomer)
            assert_same(state[1], loaded)
            named = [r.getMessage() for r in caplog.records if str(evil.host.peer_id) in r.getMessage()]
            assert len(named) >= 1 and all("outvoted" in message for message in named), named
            for sharing in (honest, hostile):
                await sharing.shutdown()

    run(main())


def test_a_single_donor_is_adopted_whatever_its_state():
    async def main():
        async with swarm(2) as (donor, newcomer):
            state = poisoned(make_state())  # nothing to compare it with: no regression for a lone donor
            sharing = await share(donor, state, priority=1000)
            metadata, loaded = await load(newcomer)
            assert metadata == state[0]
            assert_same(state[1], loaded)
            await sharing.shutdown()

    run(main())


def test_a_state_only_one_donor_offers_at_the_swarm_epoch_is_checked_against_older_ones(caplog):
    """A peer that stepped alone (and blew up) must not be adopted just because the swarm's epoch,
    which it pushed, is one that only it has reached; a healthy lone leader still is."""
    caplog.set_level(logging.WARNING, logger="plexus")

    async def main():
        async with swarm(4) as (behind1, behind2, ahead, newcomer):
            old = make_state()
            older = [await share(peer, old, priority=1) for peer in (behind1, behind2)]
            leader = await share(ahead, poisoned(old, 100.0), priority=2)
            with pytest.raises(StateDownloadError, match="exceeds"):
                await load(newcomer, min_priority=2, max_attempts=2)
            named = [r.getMessage() for r in caplog.records if str(ahead.host.peer_id) in r.getMessage()]
            assert named and "only it offers a state this new" in named[0], named
            await leader.shutdown()
            healthy = nudged(old, 0.05)
            leader = await share(ahead, healthy, priority=2)
            _, loaded = await load(newcomer, min_priority=2)
            assert_same(healthy[1], loaded)
            for sharing in (*older, leader):
                await sharing.shutdown()

    run(main())
