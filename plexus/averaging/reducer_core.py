"""Bookkeeping of one reducer's span in a butterfly all-reduce: no I/O, time is a parameter.

Theory of operation
-------------------
A reducer owns one span of the group's vector, cut into `num_parts` parts; each live *sender*
contributes its values of every part, strictly in order 0, 1, ... This core tracks, per sender,
the next part it owes (`next_part`), and which senders are live or excluded (with the reason).
It holds no tensors: the driver (`allreduce.AllReduceRunner`) sums the values, and asks the core
what that completes.

  * Completion frontier: the parts every live sender has contributed are exactly those below
    `frontier = min(next_part[s] for live s)`. Part k is complete once the frontier passes it, and
    its average is over exactly the senders that contributed it by then. Excluding a sender may
    move the frontier; its contributions to parts not yet complete stay in.
  * Window: a sender may contribute part k only when k < frontier + window, which bounds the
    parts a reducer holds in flight.
  * Settling: no part is contributed before every live sender has opened its stream (`open`) or
    been excluded, because each sender's weight is bounded relative to the others' (see
    `aggregation.bounded_weights`) and the weights must be known before the first value is added.
    Until then only senders that have not opened their stream owe anything.
  * Stall clocks: a live sender that owes a part the window lets it send has a clock, restarted
    when it contributes or when the frontier moves and lets it through again; a sender held back
    by the window (or waiting for the others to open their streams) is not owing, so its clock
    does not run. `expired(now)` names the senders whose clock passed `sender_timeout`,
    `next_deadline()` says when to look next. All clocks start when the core is made (a sender
    must open its stream in time too) and restart when the weights settle. Exempt senders (the
    reducer's own) have no clock and count as open.

Time is passed in (`now`) by the driver, so the rules can be tested without a loop or a clock.
Left out: the values and their weights, the answers, and deciding whom to exclude and why (the
driver's: timeouts, garbage, broken streams).
"""

from __future__ import annotations

from collections.abc import Iterable


class ReducerCore:
    """Who has contributed which part of one reducer's span, who is excluded, what is complete,
    whose stall clock has run out (see the module comment)."""

    def __init__(
        self,
        num_parts: int,
        senders: Iterable[int],
        *,
        window: int,
        sender_timeout: float,
        now: float,
        exempt: Iterable[int] = (),
    ):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.num_parts, self.window, self.sender_timeout = num_parts, window, sender_timeout
        self.next_part = {sender: 0 for sender in senders}
        self.live = set(self.next_part)
        self.excluded: dict[int, str] = {}
        self.exempt = frozenset(exempt)
        self.opened = set(self.exempt & self.live)
        self._since = {sender: now for sender in self.next_part}
        self.frontier = 0
        self._advance(now)

    @property
    def done(self) -> bool:
        return self.frontier >= self.num_parts

    @property
    def settled(self) -> bool:
        """Every live sender has opened its stream: the weights are known, parts may come."""
        return self.live <= self.opened

    def open(self, sender: int, now: float) -> bool:
        """`sender` opened its stream (its weight is known); True if that settles the weights."""
        if sender not in self.live or sender in self.opened:
            raise ValueError(f"sender {sender} is not a live sender that has yet to open its stream")
        self.opened.add(sender)
        return self._settle(now)

    def _settle(self, now: float) -> bool:
        if not self.settled:
            return False
        for sender in self.live:  # the senders that waited for the others start a fresh clock
            self._since[sender] = now
        return True

    def allowed(self, sender: int) -> bool:
        """Whether `sender` may contribute its next part now."""
        part = self.next_part[sender]
        return (
            sender in self.live
            and self.settled
            and part < self.num_parts
            and part < self.frontier + self.window
        )

    def contribute(self, sender: int, index: int, now: float) -> range:
        """Record part `index` from `sender`; returns the parts this completes.

        Raises ValueError when the sender is excluded, out of order or beyond the window (the
        driver turns that into excluding the sender)."""
        if sender not in self.live:
            raise ValueError(f"sender {sender} is not a live sender of this span")
        expected = self.next_part[sender]
        if index != expected:
            raise ValueError(f"expected part {expected}, got part {index}")
        if not self.settled:
            raise ValueError(f"part {index} came before every sender opened its stream (weights unknown)")
        if not self.allowed(sender):
            raise ValueError(
                f"part {index} is beyond the window (frontier {self.frontier}, window {self.window})"
            )
        self.next_part[sender] = expected + 1
        self._since[sender] = now
        return self._advance(now)

    def exclude(self, sender: int, reason: str, now: float) -> range:
        """Drop `sender` for the rest of the round; returns the parts this completes (see `settled`
        for whether this settled the weights too)."""
        if sender not in self.live:
            return range(0)
        was_settled = self.settled
        self.live.discard(sender)
        self.excluded[sender] = reason
        if not was_settled:
            self._settle(now)
        return self._advance(now)

    def _advance(self, now: float) -> range:
        old = self.frontier
        new = min((self.next_part[s] for s in self.live), default=self.num_parts)
        new = min(new, self.num_parts)
        if new > old:
            for sender in self.live:  # senders held at the old window edge start a fresh clock
                if self.next_part[sender] >= old + self.window:
                    self._since[sender] = now
            self.frontier = new
        return range(old, new)

    def _owing(self) -> Iterable[int]:
        if not self.settled:
            return (s for s in self.live if s not in self.opened)
        return (s for s in self.live if s not in self.exempt and self.allowed(s))

    def next_deadline(self) -> float | None:
        return min((self._since[s] + self.sender_timeout for s in self._owing()), default=None)

    def expired(self, now: float) -> list[int]:
        return sorted(s for s in self._owing() if now >= self._since[s] + self.sender_timeout)

    def __repr__(self) -> str:
        opened = "settled" if self.settled else f"opened {sorted(self.opened)}"
        return (
            f"<ReducerCore {self.frontier}/{self.num_parts} parts, live {sorted(self.live)}, {opened}, "
            f"excluded {sorted(self.excluded)}>"
        )
