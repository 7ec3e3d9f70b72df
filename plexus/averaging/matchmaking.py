"""Decentralized matchmaking: peers that look for a group at the same time find one another via the DHT.

Theory of operation (the decisions live in `matchmaking_state.py`; this is the asyncio driver).

`look_for_group(gather=..., deadline=...)` runs one round:
1. Declare: store `True` (or the round's tag, see below) under `{prefix}.0b{bits}`, subkey = our
   peer id, expiring at our declared time T = max(now + min_matchmaking_time, scheduled_time), capped at the deadline (our clock),
   and never sooner than now + request_timeout (followers need that long to reach us).
   Client-mode peers never declare and never lead.
2. Read the bucket with `get(latest=True)` as soon as our declaration has landed (peers that
   started with us have then likely landed too), and again while we look: after 50 ms, doubling
   to about a second while nothing changes, and at once after losing a leader.
3. Ask the most senior peer we see (smallest (T, peer id), only peers more senior than us) to take
   us in; follow redirects (NOT_A_LEADER / GROUP_DISBANDED name the leader to try next), skip
   peers that refused us until they declare anew. Meanwhile we accept less senior peers ourselves.
4. A leader assembles the moment it holds target_group_size peers, or when its own clock reaches T
   with at least min_group_size; with fewer it declares a later T (followers hear the new wait).
   Assembly: random group_id, shuffled order, everyone's gather bytes, sent as BEGIN_ALLREDUCE.
5. A follower waits for BEGIN for the wait the leader announced plus request_timeout, never past
   its own deadline; if the leader disbands, vanishes or sends nonsense, it goes back to step 3.
6. The round ends with a group, or with None at the deadline; we then withdraw the declaration
   (store `False` just after T) in the background.

Rounds with a `round_tag` (e.g. "the state of epoch 12") meet only rounds with the same tag: the
tag is what they declare, a round reads only declarations of its own tag, and leaders take only
followers that ask with it. Otherwise a peer's round for one epoch could pair with a partner's
round for the next, again and again, and average nothing.

Every wait is bounded by request_timeout or the deadline. Skew between clocks changes who leads,
not whether a group forms: seniority compares declared numbers, each leader times its own
assembly on its own clock, and followers receive durations rather than foreign timestamps.

One stream handler per host serves every prefix (`_services`): the request names its group key,
and unknown prefixes get BAD_GROUP_KEY.
"""

import asyncio
import math
import os
import random
import weakref
from collections.abc import Callable

from ..dht.node import DHTNode
from ..p2p import rpc
from ..p2p.host import Host
from ..p2p.identity import PeerID
from ..utils.logging import get_logger
from ..utils.timing import get_dht_time
from .group_info import GroupInfo, check_group_bits, check_group_key, make_group_key, next_group_bits
from .matchmaking_messages import (
    JOIN_PROTOCOL,
    MAX_GATHER_BYTES,
    MAX_JOIN_MESSAGE_SIZE,
    JoinCode,
    JoinRequest,
    JoinResponse,
)
from .matchmaking_state import LeaderProtocolError, MatchmakingState, Phase

logger = get_logger(__name__)

GROUP_ID_BYTES = 20
MAX_JOIN_REQUEST_SIZE = MAX_GATHER_BYTES + (4 << 10)
FIRST_POLL_INTERVAL = 0.05
MAX_REDIRECTS = 16  # consecutive leader suggestions we follow before going back to the DHT view
_SHORT_REFUSALS = {
    JoinCode.NOT_A_LEADER,
    JoinCode.GROUP_DISBANDED,
    JoinCode.NOT_DECLARED,
    JoinCode.DUPLICATE_PEER_ID,
    JoinCode.PROTOCOL_VIOLATION,
}

_services: "weakref.WeakKeyDictionary[Host, dict[str, Matchmaking]]" = weakref.WeakKeyDictionary()


class _Mailbox:
    """Messages for one accepted follower: at most one pending (a final answer is never overwritten)."""

    def __init__(self):
        self._pending: JoinResponse | None = None
        self._ready = asyncio.Event()

    def post(self, response: JoinResponse) -> None:
        if self._pending is not None and self._pending.join_code is not JoinCode.ACCEPTED:
            return
        self._pending = response
        self._ready.set()

    async def get(self) -> JoinResponse:
        await self._ready.wait()
        self._ready.clear()
        response, self._pending = self._pending, None
        assert response is not None  # (put before _ready was set)
        return response


class Matchmaking:
    """Finds a group of peers to average with; see the module comment for the protocol."""

    def __init__(
        self,
        host: Host,
        dht_node: DHTNode,
        *,
        prefix: str,
        schema_hash: bytes,
        target_group_size: int | None,
        min_group_size: int = 2,
        initial_group_bits: str = "",
        min_matchmaking_time: float = 5.0,
        request_timeout: float = 3.0,
        client_mode: bool = False,
        clock: Callable[[], float] = get_dht_time,
        assemble_when_all_joined: bool = False,
    ):
        if min_matchmaking_time < 0 or request_timeout <= 0:
            raise ValueError("min_matchmaking_time must be >= 0 and request_timeout > 0")
        self.host, self.dht_node, self.prefix = host, dht_node, prefix
        self.peer_id: PeerID = host.peer_id
        self._group_bits = check_group_bits(initial_group_bits)
        make_group_key(prefix, initial_group_bits)  # rejects a prefix with dots early
        self.target_group_size, self.min_group_size = target_group_size, min_group_size
        self.min_matchmaking_time, self.request_timeout = min_matchmaking_time, request_timeout
        self.client_mode, self._clock = client_mode, clock
        self.assemble_when_all_joined = assemble_when_all_joined
        """With no target_group_size: lead a group as soon as every peer seen looking has joined us."""
        self._state = MatchmakingState(
            self.peer_id,
            schema_hash=schema_hash,
            client_mode=client_mode,
            target_group_size=target_group_size,
            min_group_size=min_group_size,
        )
        self._rng = random.SystemRandom()
        self._max_poll_interval = min(1.0, max(0.1, min_matchmaking_time / 5))
        self._one_round = asyncio.Lock()  # rounds run one at a time (a cancelled one may still unwind)
        self._wakeup, self._poll_now = (
            asyncio.Event(),
            asyncio.Event(),
        )  # the current round's (new each round)
        self._view: dict[PeerID, float] = {}
        self._declared_until: float | None = None  # the latest time we declared this round
        self._stores: set[asyncio.Task] = set()  # this round's declarations still being stored
        self._refused: dict[PeerID, tuple[float | None, float]] = {}
        self._tasks: set[asyncio.Task] = set()
        self.last_leader: PeerID | None = None
        """The leader of the last group we formed (our own id if we led it)."""
        self.last_round_alone = False
        """Whether the last round ended early because no other peer was looking (see `alone_timeout`)."""
        self._register()

    # --- configuration ------------------------------------------------------------------------

    @property
    def group_bits(self) -> str:
        return self._group_bits

    @group_bits.setter
    def group_bits(self, bits: str) -> None:
        self._group_bits = check_group_bits(bits)

    @property
    def group_key(self) -> str:
        return make_group_key(self.prefix, self._group_bits)

    def _register(self) -> None:
        services = _services.get(self.host)
        if services is None:
            services = _services[self.host] = {}
            rpc.add_handler(
                self.host,
                JOIN_PROTOCOL,
                _make_join_handler(services),
                bytes,
                JoinResponse,
                stream_input=True,
                stream_output=True,
                max_message_size=MAX_JOIN_REQUEST_SIZE,
            )
        if self.prefix in services:
            raise ValueError(f"this host already runs matchmaking for prefix {self.prefix!r}")
        services[self.prefix] = self

    async def shutdown(self) -> None:
        """Stop serving this prefix and finish background withdrawals (bounded by request_timeout)."""
        services = _services.get(self.host, {})
        if services.get(self.prefix) is self:
            del services[self.prefix]
            if not services:
                self.host.remove_stream_handler(JOIN_PROTOCOL)
                _services.pop(self.host, None)
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.request_timeout)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- one round ----------------------------------------------------------------------------

    async def look_for_group(
        self,
        *,
        gather: bytes,
        deadline: float,
        scheduled_time: float | None = None,
        expected_group_size: int | None = None,
        alone_timeout: float | None = None,
        round_tag: bytes = b"",
    ) -> GroupInfo | None:
        """Find a group before `deadline` (event-loop time); None if there is none by then.

        `scheduled_time` (DHT time) is the earliest moment we want to assemble; by default
        now + min_matchmaking_time. With `expected_group_size`, a group does not form before that
        time with fewer members. With `alone_timeout`, the round gives up (None, and
        `last_round_alone` is set) once it is that many seconds past the scheduled time with nobody
        else in sight: no follower, and a fresh read of the bucket shows no other live declaration
        (peers that failed to answer us do not count). With `round_tag`, only rounds with the same
        tag meet (see the module comment). On success the group bits move on (see
        `next_group_bits`).

        Rounds run one at a time: a round started while the previous one is still unwinding (it
        was cancelled and is withdrawing its declaration) waits for it to finish.
        """
        if len(gather) > MAX_GATHER_BYTES:
            raise ValueError(f"gather of {len(gather)} bytes exceeds the {MAX_GATHER_BYTES}-byte limit")
        async with self._one_round:
            return await self._one_round_of_matchmaking(
                bytes(gather), deadline, scheduled_time, expected_group_size, alone_timeout, bytes(round_tag)
            )

    async def _one_round_of_matchmaking(
        self,
        gather: bytes,
        deadline: float,
        scheduled_time: float | None,
        expected_group_size: int | None,
        alone_timeout: float | None,
        round_tag: bytes,
    ) -> GroupInfo | None:
        loop = asyncio.get_running_loop()
        group, key = None, self.group_key
        self.last_round_alone = False
        self._state.start(key, gather, expected_group_size, round_tag)
        self._wakeup, self._poll_now = asyncio.Event(), asyncio.Event()
        self._view, self._refused, self._declared_until = {}, {}, None
        alone_after = None
        if alone_timeout is not None:
            alone_after = (
                scheduled_time if scheduled_time is not None else self._clock() + self.min_matchmaking_time
            ) + alone_timeout
        poller = None
        try:
            if not self.client_mode:  # the store runs while we read the bucket and ask leaders
                self._declare(key, deadline, scheduled_time, self.min_matchmaking_time)
            poller = loop.create_task(self._poll(key))
            group = await self._match(key, deadline, alone_after)
            return group
        finally:  # the synchronous part first: a second cancellation cannot skip it
            if self._state.phase in (Phase.LOOKING, Phase.FOLLOWING):
                self._deliver(self._state.stop("the leader stopped looking for a group"))
            if self._declared_until is not None:
                self._spawn(self._withdraw(key, self._declared_until, self._stores))
            self._stores = set()
            if group is not None:
                self.last_leader = self._state.leader
                self._group_bits = next_group_bits(
                    self._group_bits, group, self.peer_id, self.target_group_size
                )
            if poller is not None:
                poller.cancel()
                await asyncio.gather(poller, return_exceptions=True)

    async def _match(self, key: str, deadline: float, alone_after: float | None) -> GroupInfo | None:
        loop = asyncio.get_running_loop()
        suggestion, redirects = None, 0
        while True:
            self._wakeup.clear()  # cleared before checking, so a wake-up during the checks is kept
            if loop.time() >= deadline:
                logger.debug(f"{self._state!r}: no group before the deadline")
                return None
            view = self._view if self.assemble_when_all_joined else None
            if self._state.should_assemble(self._clock(), view):
                return self._assemble()
            if alone_after is not None and self._clock() >= alone_after:
                if await self._nobody_else_looking(key):
                    logger.debug(f"{self._state!r}: nobody else is looking for a group; giving up")
                    self.last_round_alone = True
                    return None
                alone_after = self._clock() + self._max_poll_interval  # look again a little later
                continue
            if self._own_time_passed() and not self._state.should_assemble(self._clock(), view):
                if self._extend(key, deadline):
                    continue
            leader = suggestion if suggestion is not None else next(iter(self._candidates()), None)
            suggestion = None
            if leader is not None:
                outcome = await self._try_leader(leader, deadline)
                if isinstance(outcome, GroupInfo):
                    return outcome
                if isinstance(outcome, PeerID) and redirects < MAX_REDIRECTS and not self._skip(outcome):
                    suggestion, redirects = outcome, redirects + 1
                else:
                    redirects = 0
                continue
            wake_at = min(deadline, self._own_timer(), self._loop_time_of(alone_after))
            try:
                async with asyncio.timeout_at(wake_at):
                    await self._wakeup.wait()
            except TimeoutError:
                pass

    async def _nobody_else_looking(self, key: str) -> bool:
        """Alone: no follower, and a fresh read of the bucket shows no other live declaration of a
        peer that has not failed us."""
        if self._state.phase is not Phase.LOOKING or self._state.group_size > 1:
            return False
        view = await self._read_bucket(key)
        if view is not None:
            self._view = view
        if self._state.phase is not Phase.LOOKING or self._state.group_size > 1:
            return False  # someone joined us while we read
        now = self._clock()
        return not any(
            peer != self.peer_id and declared > now and not self._failed_us(peer)
            for peer, declared in self._view.items()
        )

    def _failed_us(self, peer: PeerID) -> bool:
        """`peer` refused us for good, or broke a join request of ours (unreachable, timed out,
        nonsense), under the declaration it still shows: it is not someone to wait for."""
        refused = self._refused.get(peer)
        return refused is not None and refused[1] == math.inf and refused[0] == self._view.get(peer)

    def _assemble(self) -> GroupInfo:
        group, notices = self._state.assemble(os.urandom(GROUP_ID_BYTES), self._rng.shuffle)
        self._deliver(notices)
        logger.debug(f"{self.peer_id.short()} assembled {group!r}")
        return group

    # --- the DHT ------------------------------------------------------------------------------

    def _declared_time(self, deadline: float, scheduled_time: float | None, wait: float) -> float:
        """T = max(now + wait, scheduled_time), capped at the deadline; `wait` is at least one
        request_timeout, or followers could not reach us in time (and with no wait at all the
        DHT would refuse a record that expires as it is stored)."""
        now = self._clock()
        latest = now + max(0.0, deadline - asyncio.get_running_loop().time())
        wanted = now + max(wait, self.request_timeout)
        if scheduled_time is not None:
            wanted = max(wanted, scheduled_time)
        return min(wanted, latest)

    def _declare(self, key: str, deadline: float, scheduled_time: float | None, wait: float) -> None:
        """Declare (or move) our time T at once; the DHT store follows in the background.

        Followers hear the new wait right away, and we may lead before the store lands (nobody
        can find us until then, but we can find others)."""
        expiration = self._declared_time(deadline, scheduled_time, wait)
        self._deliver(self._state.declare(expiration, self._clock()))
        self._declared_until = max(self._declared_until or expiration, expiration)
        self._wakeup.set()
        task = self._spawn(self._store_declaration(key, expiration, self._poll_now))
        self._stores.add(task)
        task.add_done_callback(self._stores.discard)

    async def _store_declaration(self, key: str, expiration: float, poll_now: asyncio.Event) -> None:
        stored = None  # unknown: the store timed out or broke, and may still have landed
        for attempt in range(2):  # a slow DHT (a loaded machine) gets one more chance
            try:
                async with asyncio.timeout(self.request_timeout):
                    stored = await self.dht_node.store(
                        key, self._declared_value(), expiration, subkey=self.peer_id.to_bytes()
                    )
                break
            except (TimeoutError, OSError) as error:
                logger.debug(
                    f"{self.peer_id.short()} could not declare itself under {key} "
                    f"(attempt {attempt + 1}): {error!r}"
                )
                if self._clock() >= expiration:
                    break
        poll_now.set()  # others who started with us have likely landed too: look now
        if stored is False and self._state.phase is Phase.LOOKING and self._state.declared == expiration:
            # nobody can see us, so nobody would ask us to lead; we join others instead
            logger.debug(f"{self.peer_id.short()}: declaration under {key} not stored; joining others only")
            self._deliver(self._state.declare(None, self._clock()))
            self._wakeup.set()

    def _extend(self, key: str, deadline: float) -> bool:
        """Our time came without enough peers: declare a later time if the deadline allows."""
        wait = self.min_matchmaking_time  # at least request_timeout, so never a tight loop
        old, new = self._state.declared, self._declared_time(deadline, None, wait)
        if old is not None and new <= old + 1e-3:
            return False
        logger.debug(f"{self._state!r}: not enough peers by our declared time, declaring a later one")
        self._declare(key, deadline, None, wait)
        return True

    def _declared_value(self) -> bool | bytes:
        """What we store as our declaration: True, or this round's tag."""
        return self._state.round_tag or True

    async def _withdraw(self, key: str, expiration: float, stores: set[asyncio.Task]) -> None:
        """Store False just after our last declared time (once our own stores have landed)."""
        try:
            async with asyncio.timeout(2 * self.request_timeout):
                if stores:
                    await asyncio.wait(stores)
                await self.dht_node.store(
                    key, False, math.nextafter(expiration, math.inf), subkey=self.peer_id.to_bytes()
                )
        except (TimeoutError, OSError) as error:
            logger.debug(f"{self.peer_id.short()} could not withdraw from {key}: {error!r}")

    async def _poll(self, key: str) -> None:
        """Keep `self._view` ({peer: declared time}) fresh; wake the matcher when it changes.

        The first read waits for our own declaration to land (peers that started with us have
        likely landed by then too), later ones come at intervals that double from
        FIRST_POLL_INTERVAL up to `_max_poll_interval` while nothing changes, and at once after
        we lose a leader. Every read is a beam search: polling faster only loads the replicas."""
        interval = FIRST_POLL_INTERVAL
        if self._stores:
            try:
                async with asyncio.timeout(self.request_timeout):
                    await self._poll_now.wait()
            except TimeoutError:
                pass
        while True:
            self._poll_now.clear()
            if self._state.phase is not Phase.FOLLOWING:
                view = await self._read_bucket(key)
                if view is not None and view != self._view:
                    logger.debug(f"{self.peer_id.short()} sees {len(view)} declared peers under {key}")
                    self._view, interval = view, FIRST_POLL_INTERVAL
                    self._wakeup.set()
                else:
                    interval = min(interval * 2, self._max_poll_interval)
            try:
                async with asyncio.timeout(interval):
                    await self._poll_now.wait()
            except TimeoutError:
                pass

    async def _read_bucket(self, key: str) -> dict[PeerID, float] | None:
        try:
            async with asyncio.timeout(self.request_timeout):
                found = await self.dht_node.get(key, latest=True)
        except (TimeoutError, OSError) as error:
            logger.debug(f"{self.peer_id.short()} could not read {key}: {error!r}")
            return None
        view, wanted = {}, self._declared_value()
        if found is not None and isinstance(found.value, dict):
            for subkey, entry in found.value.items():
                if type(entry.value) is type(wanted) and entry.value == wanted and isinstance(subkey, bytes):
                    try:
                        view[PeerID(subkey)] = float(entry.expiration_time)
                    except ValueError:
                        continue  # not a peer id: someone else's garbage in our bucket
        return view

    # --- asking leaders -----------------------------------------------------------------------

    def _candidates(self) -> list[PeerID]:
        return self._state.candidates(self._view, lambda peer, declared: self._skip(peer, declared))

    def _skip(self, peer: PeerID, declared: float | None = None) -> bool:
        """Whether `peer` refused us (or failed) under the declaration it still shows."""
        if peer == self.peer_id:
            return True
        refused = self._refused.get(peer)
        if refused is None:
            return False
        if declared is None:
            declared = self._view.get(peer)
        return declared == refused[0] and asyncio.get_running_loop().time() < refused[1]

    def _refuse(self, peer: PeerID, short: bool) -> None:
        until = asyncio.get_running_loop().time() + self.request_timeout if short else math.inf
        self._refused[peer] = (self._view.get(peer), until)

    def _own_time_passed(self) -> bool:
        return self._state.declared is not None and self._clock() >= self._state.declared

    def _own_timer(self) -> float:
        """Event-loop time at which our declared time comes (inf if none or already past)."""
        if self._state.declared is None or self._own_time_passed():
            return math.inf
        return self._loop_time_of(self._state.declared)

    def _loop_time_of(self, moment: float | None) -> float:
        """The event-loop time of `moment` on our (DHT) clock; inf for None."""
        if moment is None:
            return math.inf
        return asyncio.get_running_loop().time() + (moment - self._clock())

    async def _try_leader(self, leader: PeerID, deadline: float) -> GroupInfo | PeerID | None:
        """Ask `leader` to take us in. Returns the group, a leader to try next, or None."""
        loop = asyncio.get_running_loop()
        assert self._state.group_key is not None  # (a round is on)
        request = JoinRequest(
            self._state.group_key,
            self._state.schema_hash,
            None if self.client_mode else self._state.declared,
            self._state.gather,
            self.client_mode,
            self._state.round_tag,
        )
        stream, reader = None, None
        try:
            async with asyncio.timeout_at(min(deadline, loop.time() + self.request_timeout)):
                stream = await self.host.new_stream(leader, JOIN_PROTOCOL, lazy=True)
                await rpc.write_frame(stream, request)
                reader = loop.create_task(_read_response(stream))
                while not reader.done():  # wait for the answer unless our own group becomes ready first
                    self._wakeup.clear()
                    if self._state.should_assemble(self._clock()):
                        logger.debug(f"{self._state!r}: ready to assemble; no longer asking {leader.short()}")
                        _close(stream, reader)
                        return None
                    waker = loop.create_task(self._wakeup.wait())
                    timer = self._own_timer()
                    timeout = None if timer == math.inf else max(0.0, timer - loop.time())
                    try:
                        await asyncio.wait(
                            {reader, waker}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                        )
                    finally:
                        waker.cancel()
                first = reader.result()
        except Exception as error:  # unreachable, timed out, or spoke nonsense: all the leader's fault
            logger.debug(f"{self.peer_id.short()}: join request to {leader.short()} failed: {error!r}")
            self._refuse(leader, short=False)
            _close(stream, reader)
            return None
        if first is None or first.join_code is not JoinCode.ACCEPTED:
            code = first.join_code if first is not None else JoinCode.NOT_LOOKING_FOR_GROUP
            self._refuse(leader, short=code in _SHORT_REFUSALS)
            _close(stream, reader)
            logger.debug(f"{self.peer_id.short()}: {leader.short()} answered {first!r}")
            if first is not None and first.suggested_leader is not None:
                return PeerID(first.suggested_leader)
            return None
        self._deliver(self._state.on_accepted(leader))
        assert first.time_left is not None  # (JoinResponse checks: ACCEPTED carries time_left)
        return await self._follow(leader, stream, first.time_left, deadline)

    async def _follow(
        self, leader: PeerID, stream, time_left: float, deadline: float
    ) -> GroupInfo | PeerID | None:
        """Wait for our leader's BEGIN; on any trouble go back to looking."""
        loop = asyncio.get_running_loop()
        wait_until = loop.time() + time_left + self.request_timeout
        outcome, reason = None, "the leader closed the stream"
        try:
            while True:
                async with asyncio.timeout_at(min(deadline, wait_until)):
                    response = await _read_response(stream)
                if response is None:
                    break
                code = response.join_code
                if code is JoinCode.ACCEPTED:
                    assert response.time_left is not None  # (as above)
                    wait_until = loop.time() + response.time_left + self.request_timeout
                    continue
                if code is JoinCode.BEGIN_ALLREDUCE:
                    group = self._state.on_begin(leader, response)
                    await stream.close()
                    return group
                reason = f"the leader answered {response!r}"
                if response.suggested_leader is not None:
                    outcome = PeerID(response.suggested_leader)
                break
        except asyncio.CancelledError:
            stream.reset()
            raise
        except Exception as error:
            reason = "timed out waiting for the group" if isinstance(error, TimeoutError) else f"{error!r}"
            if isinstance(error, LeaderProtocolError):
                logger.warning(f"{self.peer_id.short()}: leader {leader.short()} misbehaved: {error}")
        stream.reset()
        logger.debug(f"{self.peer_id.short()} lost leader {leader.short()}: {reason}")
        self._state.on_leader_lost()
        self._refuse(leader, short=outcome is not None)
        self._poll_now.set()
        return outcome

    # --- serving followers --------------------------------------------------------------------

    async def _serve_follower(self, peer: PeerID, request: JoinRequest, requests):
        """Answer one join stream: accept or refuse, then relay updates until BEGIN or the end."""
        mailbox = _Mailbox()
        response = self._state.on_join_request(peer, request, self._clock(), mailbox)
        yield response
        if response.join_code is not JoinCode.ACCEPTED:
            return
        logger.debug(f"{self._state!r} accepted {peer.short()}")
        self._wakeup.set()  # we may be full now
        loop = asyncio.get_running_loop()
        gone = loop.create_task(anext(requests, None))  # EOF, reset or extra data: the follower left
        getter = None
        try:
            while True:
                getter = loop.create_task(mailbox.get())
                await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    break
                message = getter.result()
                yield message
                if message.join_code is not JoinCode.ACCEPTED:
                    return
        finally:
            for task in (getter, gone):
                if task is not None:
                    task.cancel()
            if gone.done() and not gone.cancelled():
                gone.exception()  # retrieved: a reset is an ordinary way to leave
            if self._state.on_follower_left(mailbox):
                logger.debug(f"{self._state!r}: follower {peer.short()} left")
                self._wakeup.set()

    def _deliver(self, notices) -> None:
        for mailbox, response in notices:
            mailbox.post(response)

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __repr__(self) -> str:
        return f"<Matchmaking {self.prefix} {self._state!r}>"


async def _read_response(stream) -> JoinResponse | None:
    frame = await rpc.read_frame(stream, MAX_JOIN_MESSAGE_SIZE)
    if frame is None:
        return None
    kind, payload = frame
    if kind == rpc.ERROR:
        raise rpc.RPCError(payload.decode(errors="replace"), stream.remote_peer, JOIN_PROTOCOL)
    return JoinResponse.decode(payload)


def _close(stream, reader) -> None:
    if reader is not None and not reader.done():
        reader.cancel()
    elif reader is not None and not reader.cancelled():
        reader.exception()
    if stream is not None:
        stream.reset()


def _make_join_handler(services: dict[str, Matchmaking]):
    async def serve_join(requests, context: rpc.RPCContext):
        raw = await anext(requests, None)
        if raw is None:
            return
        try:
            request = JoinRequest.decode(raw)
            prefix, _ = check_group_key(request.group_key)
        except Exception as error:  # any undecodable request is the sender's fault
            yield JoinResponse.refusal(JoinCode.PROTOCOL_VIOLATION, f"malformed JoinRequest: {error}")
            return
        service = services.get(prefix)
        if service is None:
            yield JoinResponse.refusal(JoinCode.BAD_GROUP_KEY, f"no averager with prefix {prefix!r} here")
            return
        async for response in service._serve_follower(context.remote_peer, request, requests):
            yield response

    return serve_join
