"""The roots of every error Plexus raises, split by who is at fault.

- `UsageError`: the caller asked for something impossible (a bad argument, option or file). The
  message says which one and what to do instead. It is also a `ValueError`.
- `PeerError`: another peer broke the rules or went away. It carries the peer id, the protocol and
  the phase, so that a log line or a handler can tell whom to blame. `PeerMisbehaved` is the one
  spelling of "the peer sent garbage" (malformed, oversized, out of order, non-finite, forged).
- `PhaseTimeout`: a deadline ran out; `phase` names what was under way ("dial", "matchmaking",
  "all-reduce part 3", ...). It is also a `TimeoutError`.
- `RankFailed`: another rank of this peer's own `torch.distributed` job crashed or stalled.

Catch `PlexusError` to catch everything Plexus raises on purpose.
"""

from __future__ import annotations

from typing import Any


class PlexusError(Exception):
    """Base of every error Plexus raises on purpose."""


class UsageError(PlexusError, ValueError):
    """The caller's fault: a bad argument, option, flag or file."""


class PeerError(PlexusError):
    """A peer's fault: it misbehaved, refused, or went away.

    Attributes:
        peer: the peer's id (a `PeerID`) when known.
        protocol: the protocol id or subsystem, e.g. "/plexus/dht/1.0.0" or "all-reduce".
        phase: what was under way, e.g. "handshake", "part 3".
    """

    def __init__(
        self, message: str, *, peer: Any = None, protocol: str | None = None, phase: str | None = None
    ):
        super().__init__(message)
        self.peer, self.protocol, self.phase = peer, protocol, phase

    def __str__(self) -> str:
        where = ", ".join(
            f"{name} {value}"
            for name, value in (("peer", self.peer), ("protocol", self.protocol), ("phase", self.phase))
            if value
        )
        message = super().__str__()
        return f"{message} ({where})" if where else message


class PeerMisbehaved(PeerError):
    """The peer sent something malformed, oversized, out of order, non-finite or forged."""


class PhaseTimeout(PlexusError, TimeoutError):
    """A deadline ran out during `phase`."""

    def __init__(self, message: str, *, phase: str | None = None):
        super().__init__(message)
        self.phase = phase


class RankFailed(PlexusError):
    """Another rank of this peer's `torch.distributed` job crashed, stalled past the job's timeout, or
    failed its step: the job cannot go on with its round, so this rank stops too.

    Attributes:
        rank: the rank that failed, when known (None when a collective only saw someone missing).
        phase: what the job was doing, e.g. "step", "construction", "load state".
    """

    def __init__(self, message: str, *, rank: int | None = None, phase: str | None = None):
        super().__init__(message)
        self.rank, self.phase = rank, phase
