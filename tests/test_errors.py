"""The error roots: who is at fault, and what a caller can catch."""

import plexus
from plexus.errors import PeerError, PeerMisbehaved, PhaseTimeout, PlexusError, RankFailed, UsageError


def test_errors_say_who_is_at_fault_and_are_catchable_from_plexus():
    assert issubclass(UsageError, ValueError) and issubclass(PhaseTimeout, TimeoutError)
    for error in (UsageError, PeerError, PeerMisbehaved, PhaseTimeout, RankFailed):
        assert issubclass(error, PlexusError) and getattr(plexus, error.__name__) is error
    error = PeerMisbehaved("sent a NaN", peer="12D3KooW", protocol="all-reduce", phase="part 3")
    assert str(error) == "sent a NaN (peer 12D3KooW, protocol all-reduce, phase part 3)"
    assert str(PeerError("went away")) == "went away" and PhaseTimeout("late", phase="dial").phase == "dial"
    assert RankFailed("rank 1 died", rank=1, phase="step").rank == 1
