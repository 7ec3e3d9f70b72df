"""Iterative Kademlia lookup for many keys at once, as a sans-I/O beam search.

Theory of operation. Each query (a DHTID) keeps a heap of *candidates* (peers heard of but not yet
asked, nearest first), the set of peers already asked, and its *beam*: the `beam_size` nearest
peers that answered. `next_queries()` hands the driver requests to send while fewer than
`num_workers` are in flight: it picks the unfinished query with the fewest requests in flight, asks
that query's nearest candidate, and packs into the same request up to `queries_per_call - 1`
other unfinished queries nearest to that peer, so one round trip advances several lookups. The
driver reports each answer with `on_response(request, neighbours_by_query)` or `on_failure`.

A query is finished when the caller says so (`finish`, e.g. a fresh enough value was found), or
when its beam has settled: no candidate and no request in flight is nearer than the farthest
member of a full beam (or, with the beam not full, nothing is left to ask or wait for). The
lookup is `done` when every query is finished; the driver then drops requests still in flight.

Stragglers. A silent peer (frozen, or its network cut) would otherwise hold every lookup that
asked it until the driver's timeout. With `straggler_timeout` set, a request outstanding longer
than the lookup's straggler limit (by the `now` the driver passes to `next_queries`/`handle_timer`;
`next_deadline()` says when to look again) becomes a *straggler*, as libp2p's Kademlia lookups mark
peers unresponsive: it no longer blocks any query from finishing and no longer takes one of the
`num_workers` slots, so the next candidate is asked in its place. A query whose beam is still
short keeps waiting for its stragglers (they may be all it has left), but only until they have
been out GIVE_UP_FACTOR times the straggler limit (or the driver's guess, if that is longer: a
limit learnt from a lookup's first fast answer alone is too noisy to give up on): then they are
*abandoned*, and the query ends
with the answers it has once nothing else is left to ask. Without that, a small swarm (whose
beams never fill) flooded with frozen Sybil ids would wait out the driver's request timeout in
every lookup. A late answer still counts if it comes before the lookup is done, abandoned or not;
a failure still excludes the peer. The limit starts at
`straggler_timeout` (the driver's guess, e.g. from earlier lookups); once answers carry `now`, it
follows this lookup's own answers: STRAGGLER_FACTOR times their 90th percentile duration, at least
`min_straggler_timeout`, so a stale guess is corrected within the first round trip. At most
`max_stragglers` may be outstanding (abandoned ones included), which bounds how far a lookup can
outgrow `num_workers` when every peer is slow. Time is only ever a parameter here: nothing reads
a clock or the network.
"""

import dataclasses
import heapq
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence

from ..p2p.identity import PeerID
from .routing import DHTID

Neighbours = Sequence[tuple[DHTID, PeerID]]
# 4, not 2: on a 256-node swarm joining 16 nodes at a time in one saturated process, 2 turned ~4%
# of requests into false stragglers whose replacements (mostly new dials) slowed the joins by 10%
STRAGGLER_FACTOR = 4.0
# a short beam waits for a straggler this many straggler limits, then ends without it
GIVE_UP_FACTOR = 3.0
MAX_DURATIONS = 256  # answers remembered per lookup for the straggler limit


@dataclasses.dataclass(frozen=True, eq=False)
class TraversalRequest:
    """Ask `peer_id` (DHT id `node_id`) about `queries`; compared by identity."""

    node_id: DHTID
    peer_id: PeerID
    queries: tuple[DHTID, ...]
    sent_at: float = 0.0


class _QueryState:
    __slots__ = ("asked", "beam", "candidates", "finished", "in_flight", "query", "straggling")

    def __init__(self, query: DHTID):
        self.query = query
        self.candidates: list[tuple[int, DHTID]] = []
        self.asked: set[DHTID] = set()
        self.beam: list[tuple[int, DHTID]] = []  # max-heap of the nearest responders, as (-distance, id)
        self.in_flight: list[DHTID] = []
        # asked long ago: they hold this query open only while its beam is short
        self.straggling: list[DHTID] = []
        self.finished = False


class Traversal:
    """A multi-key beam search; see the module docstring for the protocol between it and its driver."""

    def __init__(
        self,
        queries: Iterable[DHTID],
        initial_nodes: Mapping[DHTID, Neighbours] | Neighbours,
        beam_size: int,
        num_workers: int = 4,
        queries_per_call: int | None = None,
        exclude: Iterable[DHTID] = (),
        straggler_timeout: float | None = None,
        min_straggler_timeout: float = 0.0,
        max_stragglers: int | None = None,
    ):
        if beam_size < 1 or num_workers < 1:
            raise ValueError("beam_size and num_workers must be positive")
        if straggler_timeout is not None and straggler_timeout < 0:
            raise ValueError(f"straggler_timeout must be non-negative, got {straggler_timeout}")
        self.straggler_timeout, self.min_straggler_timeout = straggler_timeout, min_straggler_timeout
        self._durations: list[float] = []  # of this lookup's answers, when the driver said `now`
        self.max_stragglers = 4 * num_workers if max_stragglers is None else max_stragglers
        self._stragglers: set[TraversalRequest] = set()
        self._abandoned: set[TraversalRequest] = set()  # stragglers no query waits for any more
        self._states = {query: _QueryState(query) for query in queries}
        self.beam_size, self.num_workers = beam_size, num_workers
        self.queries_per_call = queries_per_call or max(1, math.isqrt(len(self._states)))
        self._peers: dict[DHTID, PeerID] = {}
        self._failed: set[DHTID] = set(exclude)
        self._in_flight: set[TraversalRequest] = set()
        self._order = itertools.count()
        for query, state in self._states.items():
            nodes = initial_nodes.get(query, ()) if isinstance(initial_nodes, Mapping) else initial_nodes
            self._add_candidates(state, nodes)

    @property
    def queries(self) -> tuple[DHTID, ...]:
        return tuple(self._states)

    def _add_candidates(self, state: _QueryState, nodes: Neighbours) -> None:
        for node_id, peer_id in nodes:
            if node_id in self._failed or node_id in state.asked:
                continue
            self._peers.setdefault(node_id, peer_id)
            heapq.heappush(state.candidates, (node_id ^ state.query, node_id))

    def _nearest_candidate(self, state: _QueryState) -> tuple[int, DHTID] | None:
        while state.candidates:
            distance, node_id = state.candidates[0]
            if node_id not in state.asked and node_id not in self._failed:
                return distance, node_id
            heapq.heappop(state.candidates)
        return None

    def _beam_bound(self, state: _QueryState) -> float:
        return -state.beam[0][0] if len(state.beam) >= self.beam_size else math.inf

    def _update_finished(self, state: _QueryState) -> bool:
        if not state.finished:
            bound = self._beam_bound(state)
            candidate = self._nearest_candidate(state)
            waiting = any((node_id ^ state.query) < bound for node_id in state.in_flight) or (
                state.straggling and len(state.beam) < self.beam_size
            )
            if not waiting and (candidate is None or candidate[0] >= bound):
                state.finished = True
        return state.finished

    @property
    def straggler_limit(self) -> float | None:
        """How long a request may be outstanding before it turns into a straggler (None: never)."""
        if self.straggler_timeout is None:
            return None
        if not self._durations:
            return self.straggler_timeout
        ordered = sorted(self._durations)
        p90 = ordered[(9 * len(ordered)) // 10]
        return max(self.min_straggler_timeout, STRAGGLER_FACTOR * p90)

    def _give_up_limit(self, straggler_limit: float) -> float:
        assert self.straggler_timeout is not None  # there is a straggler limit only with a timeout
        return GIVE_UP_FACTOR * max(straggler_limit, self.straggler_timeout)

    def handle_timer(self, now: float) -> None:
        """Turn requests outstanding for the straggler limit or longer into stragglers, oldest
        first, while fewer than `max_stragglers` are outstanding; abandon stragglers outstanding
        GIVE_UP_FACTOR limits or longer."""
        limit = self.straggler_limit
        if limit is None:
            return
        # `sent_at + limit` exactly as in next_deadline(), so a driver woken at the deadline finds it due
        overdue = sorted((r for r in self._in_flight if r.sent_at + limit <= now), key=lambda r: r.sent_at)
        for request in overdue[: max(0, self.max_stragglers - len(self._stragglers))]:
            self._in_flight.discard(request)
            self._stragglers.add(request)
            for query in request.queries:
                state = self._states[query]
                state.in_flight.remove(request.node_id)
                state.straggling.append(request.node_id)
        give_up = self._give_up_limit(limit)
        for request in self._stragglers - self._abandoned:
            if request.sent_at + give_up <= now:
                self._abandoned.add(request)
                for query in request.queries:
                    self._states[query].straggling.remove(request.node_id)

    def next_deadline(self) -> float | None:
        """When the next request turns into a straggler or a straggler is abandoned; None when time
        alone changes nothing (no straggler timeout, or nothing that time could change)."""
        limit = self.straggler_limit
        if limit is None:
            return None
        give_up = self._give_up_limit(limit)
        deadlines = [request.sent_at + give_up for request in self._stragglers - self._abandoned]
        if len(self._stragglers) < self.max_stragglers:
            deadlines.extend(request.sent_at + limit for request in self._in_flight)
        return min(deadlines, default=None)

    def next_queries(self, now: float = 0.0) -> list[TraversalRequest]:
        """Requests to send now (stamped `now`), keeping at most `num_workers` in flight besides
        the stragglers; may be empty. Runs `handle_timer(now)` first."""
        self.handle_timer(now)
        requests = []
        while len(self._in_flight) < self.num_workers:
            open_states = [s for s in self._states.values() if not self._update_finished(s)]
            askable = [s for s in open_states if self._nearest_candidate(s) is not None]
            if not askable:
                break
            primary = min(askable, key=lambda s: len(s.in_flight))
            _, node_id = heapq.heappop(primary.candidates)
            others = [s for s in askable if s is not primary and node_id not in s.asked]
            others = heapq.nsmallest(self.queries_per_call - 1, others, key=lambda s: s.query ^ node_id)
            queries = tuple(s.query for s in (primary, *others))
            request = TraversalRequest(node_id, self._peers[node_id], queries, now)
            for state in (primary, *others):
                state.asked.add(node_id)
                state.in_flight.append(node_id)
            self._in_flight.add(request)
            requests.append(request)
        return requests

    def _complete(self, request: TraversalRequest) -> list[_QueryState]:
        states = [self._states[query] for query in request.queries]
        if request in self._stragglers:  # no longer counted in any query's in_flight
            self._stragglers.discard(request)
            if request in self._abandoned:
                self._abandoned.discard(request)
            else:
                for state in states:
                    state.straggling.remove(request.node_id)
            return states
        self._in_flight.discard(request)
        for state in states:
            state.in_flight.remove(request.node_id)
        return states

    def on_response(
        self, request: TraversalRequest, neighbours: Mapping[DHTID, Neighbours], now: float | None = None
    ) -> None:
        """The peer answered (a straggler too): it joins the beam of each query it was asked, and
        its neighbours become candidates of the queries still open. With `now`, how long it took
        tunes the straggler limit."""
        if now is not None and len(self._durations) < MAX_DURATIONS:
            self._durations.append(max(0.0, now - request.sent_at))
        for state in self._complete(request):
            entry = (-(request.node_id ^ state.query), request.node_id)
            if len(state.beam) < self.beam_size:
                heapq.heappush(state.beam, entry)
            elif entry > state.beam[0]:
                heapq.heapreplace(state.beam, entry)
            if not state.finished:
                self._add_candidates(state, neighbours.get(state.query, ()))

    def on_failure(self, request: TraversalRequest) -> None:
        """The peer did not answer: it is skipped by every query from now on."""
        self._failed.add(request.node_id)
        self._complete(request)

    def add_candidates(self, query: DHTID, nodes: Neighbours) -> None:
        """More peers to ask for `query` while it is open (e.g. farther entries of the driver's own
        table, once the nearest ones failed); peers already asked or failed are ignored."""
        state = self._states[query]
        if not state.finished:
            self._add_candidates(state, nodes)

    def finish(self, query: DHTID) -> None:
        self._states[query].finished = True

    def is_finished(self, query: DHTID) -> bool:
        return self._update_finished(self._states[query])

    @property
    def done(self) -> bool:
        return all(self._update_finished(state) for state in self._states.values())

    @property
    def in_flight(self) -> int:
        """Requests in flight that still hold their queries open (stragglers not counted)."""
        return len(self._in_flight)

    def is_straggler(self, request: TraversalRequest) -> bool:
        return request in self._stragglers

    @property
    def stragglers(self) -> int:
        return len(self._stragglers)

    def nearest(self, query: DHTID) -> list[tuple[DHTID, PeerID]]:
        """The peers that answered for `query`, nearest first (at most `beam_size`)."""
        beam = sorted(self._states[query].beam, reverse=True)
        return [(node_id, self._peers[node_id]) for _, node_id in beam]

    def __repr__(self) -> str:
        finished = sum(state.finished for state in self._states.values())
        return (
            f"Traversal({finished}/{len(self._states)} finished, {len(self._in_flight)} in flight, "
            f"{len(self._stragglers)} straggling, {len(self._abandoned)} of them abandoned)"
        )
