"""Beam search over a grid of experts, as a pure state machine: prefixes out, DHT answers in.

Theory of operation
-------------------
Experts live on a grid: uid `prefix.i.j.k`, one coordinate per gating dimension, and an expert's
score for a sample is the sum of that sample's per-dimension scores at its coordinates. Servers
announce each prefix level (`expert_registry`), so a prefix's DHT entry lists which next
coordinates are populated, each with one uid that lives under it.

`BeamSearch` finds the `beam_size` best experts for one sample without reading the whole grid:

1. *First dimension.* Try `prefix.i.` in descending score order, `beam_size - len(beam)` at a time,
   until `beam_size` populated prefixes are found or the dimension is exhausted.
2. *Each further dimension.* Extend every beam prefix by each populated next coordinate, score
   the extensions (prefix score + the coordinate's score), keep the `beam_size` best and ask for
   them; the populated ones form the next beam. At the last dimension the entries are the experts.
3. Every entry seen on the way names a real expert; those with a full set of coordinates inside
   the grid are candidates with their exact score. The answer is the `beam_size` best candidates.

On a fully populated grid this returns exactly the top `beam_size` experts (an expert in the top
k has, at every level, fewer than k prefixes that beat its own prefix). On a sparse grid it is the
usual beam-search approximation.

The driver (`beam_search.MoEBeamSearcher`) asks `wanted()`, fetches those prefixes from the DHT
(one lookup for all samples of a batch), and calls `feed()` until `done`. Nothing here does I/O.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

from ...p2p.identity import PeerID
from ..expert_uid import FLAT_EXPERT, UID_DELIMITER, Coordinate, ExpertPrefix, ExpertUID

Successors = Mapping[Coordinate, tuple[ExpertUID, PeerID]]


class BeamSearch:
    """The search for one sample.

    Args:
        prefix: the grid's uid prefix, ending in the delimiter (`ffn.`).
        grid_scores: one sequence of floats per dimension (its length is the grid size there).
        beam_size: how many experts to find (and how wide the beam is).
    """

    def __init__(self, prefix: ExpertPrefix, grid_scores: Sequence[Sequence[float]], beam_size: int):
        if not prefix.endswith(UID_DELIMITER):
            raise ValueError(f"uid prefix {prefix!r} must end with {UID_DELIMITER!r}")
        if beam_size < 1 or not grid_scores or any(len(scores) == 0 for scores in grid_scores):
            raise ValueError(
                f"need beam_size >= 1 and a non-empty grid, got {beam_size} and "
                f"{[len(scores) for scores in grid_scores]}"
            )
        self.prefix, self.beam_size = prefix, beam_size
        self.scores = [[float(x) for x in scores] for scores in grid_scores]
        self.dims = len(self.scores)
        self._first = sorted(range(len(self.scores[0])), key=lambda i: (-self.scores[0][i], i))
        self._next_first = 0
        self._beam: list[tuple[float, ExpertPrefix, Successors]] = []
        self._depth = 1  # coordinates in the prefixes being asked for
        self._pending: list[tuple[float, ExpertPrefix]] = []
        self._candidates: dict[ExpertUID, tuple[float, PeerID]] = {}
        self.rounds = 0
        self._ask_first_dimension()

    @property
    def done(self) -> bool:
        return not self._pending

    def wanted(self) -> list[ExpertPrefix]:
        """Prefixes whose successors the search needs next (empty once done)."""
        return [prefix for _, prefix in self._pending]

    def feed(self, successors: Mapping[ExpertPrefix, Successors]) -> None:
        """Give the successors of every wanted prefix (a missing or empty one: nothing there)."""
        if not self._pending:
            raise RuntimeError("the search is done; nothing was asked for")
        self.rounds += 1
        answered = [(score, prefix, successors.get(prefix) or {}) for score, prefix in self._pending]
        self._pending = []
        for _, _, entries in answered:
            self._collect(entries)
        populated = [item for item in answered if item[2]]
        if self._depth == 1:
            self._beam.extend(populated)
            if len(self._beam) < self.beam_size and self._next_first < len(self._first):
                self._ask_first_dimension()
                return
        else:
            self._beam = populated
        self._extend_beam()

    def result(self) -> list[tuple[ExpertUID, PeerID]]:
        """The best experts found, best first: (uid, peer id) pairs, at most beam_size."""
        return [(uid, peer_id) for uid, (_, peer_id) in self._best()]

    def scored_result(self) -> list[tuple[float, ExpertUID]]:
        """Like `result`, with each expert's score instead of its peer."""
        return [(score, uid) for uid, (score, _) in self._best()]

    def _best(self) -> list[tuple[ExpertUID, tuple[float, PeerID]]]:
        return heapq.nsmallest(
            self.beam_size, self._candidates.items(), key=lambda item: (-item[1][0], item[0])
        )

    # --- steps ---------------------------------------------------------------------------------

    def _ask_first_dimension(self) -> None:
        need = self.beam_size - len(self._beam)
        chosen = self._first[self._next_first : self._next_first + need]
        self._next_first += len(chosen)
        self._pending = [(self.scores[0][i], f"{self.prefix}{i}{UID_DELIMITER}") for i in chosen]

    def _extend_beam(self) -> None:
        """Ask for the best extensions of the beam by one coordinate, or finish at the last dimension."""
        dim = self._depth  # the dimension of the coordinates the beam's successors carry
        if dim >= self.dims - 1 or not self._beam:
            self._pending = []  # the last dimension's entries are the experts: collected already
            return
        scores = self.scores[dim]
        extensions = [
            (score + scores[c], f"{prefix}{c}{UID_DELIMITER}")
            for score, prefix, entries in self._beam
            for c in entries
            if 0 <= c < len(scores)
        ]
        self._pending = heapq.nsmallest(self.beam_size, extensions, key=lambda item: (-item[0], item[1]))
        self._depth += 1
        if not self._pending:
            self._beam = []

    def _collect(self, entries: Successors) -> None:
        for uid, peer_id in entries.values():
            score = self._score(uid)
            if score is not None:
                self._candidates[uid] = (score, peer_id)

    def _score(self, uid: ExpertUID) -> float | None:
        """The uid's exact score, or None when it is not a point of this grid."""
        if not uid.startswith(self.prefix):
            return None
        coordinates = uid[len(self.prefix) :].split(UID_DELIMITER)
        if len(coordinates) != self.dims:
            return None
        total = 0.0
        for scores, text in zip(self.scores, coordinates):
            if not text.isdigit():
                return None
            c = int(text)
            if c >= len(scores) or c == FLAT_EXPERT:
                return None
            total += scores[c]
        return total
