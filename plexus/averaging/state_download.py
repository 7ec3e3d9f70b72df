"""Newcomer side of state download: fetch a donor's state in verified chunks, from several donors.

Theory of operation
-------------------
`load_state_from_peers` reads the donors' declarations (``{prefix}.all_averagers``, written by
`state_sharing.py`) with latest=True, orders donors by declared priority (ties at random) and
asks the first `max_donors` for manifests at once. A declaration may lag a step behind the
donor's state, so what counts is the priority each manifest *states*; a state older than
`min_priority` is never adopted. No single donor decides which state is adopted: the manifests
that answer within one stall timeout, and at most `vote_window` after the first usable one,
vote (`state_vote.py`). Waiting stops early once one
state holds more than half of the donors asked and no answer still to come could change that.
A state held by a majority of the best donors is downloaded alone; when they disagree, each of
their distinct states is downloaded and compared (norms, distances), and the donors whose
state lost are named in a warning. A state that one donor alone offers at `min_priority` while
the others are older is checked against their states. Every chunk is a hash to fetch: a donor may serve it when its
own manifest lists the same hash (so donors with identical state all serve, older ones
included, and identical chunks, e.g. zeros, are fetched once). One worker per donor claims
batches of chunks, verifies each against its SHA-256 and hands failed or corrupt batches back to
the pool; a donor that fails is not asked again in this call. An attempt ends when every wanted
chunk is in or when no donor can serve what is missing; the next attempt re-reads the DHT and
keeps every chunk already verified. Everything runs under one deadline.

Cost of the vote: the manifests of up to `max_donors` donors (asked in parallel, as before),
waiting for the slowest of them unless a majority settles it first, and, only when the donors
disagree, one download per distinct state (chunks they share are fetched once), all held in
memory until the comparison is made.

Results: (metadata, tensors); None when no donor declared itself (or all said they no longer
share); `StateDownloadError` naming every donor tried and why it failed otherwise, or saying
that no donor has reached `min_priority` yet. A state holding NaN or inf is refused
(`reject_nonfinite`): that donor is not asked again, and the next attempt goes to the others.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..compression import CompressionError, SerializedTensor, deserialize_torch_tensor
from ..dht.node import DHTNode
from ..errors import PeerError, PhaseTimeout
from ..p2p import rpc
from ..p2p.host import Host
from ..p2p.identity import PeerID
from ..p2p.messages import MessageError
from ..p2p.multiaddr import Multiaddr, MultiaddrError
from ..utils.logging import RateLimitedLog, get_logger
from ..utils.serializer import MSGPackSerializer, SerializationError
from ..utils.tensors import first_nonfinite
from .state_messages import (
    MAX_CHUNK_SIZE,
    MAX_CHUNKS_PER_REQUEST,
    MAX_METADATA_SIZE,
    MAX_REPLY_SIZE,
    MAX_REQUEST_SIZE,
    STATE_PROTOCOL,
    ReplyStatus,
    RequestKind,
    StateManifest,
    StateReply,
    StateRequest,
)
from .state_sharing import MAX_ADDR_BYTES, MAX_DECLARED_ADDRS, all_averagers_key
from .state_vote import MAX_LEAD, Ballot, Contender, Tally, content_key, judge, screen_alone, tally

logger = get_logger(__name__)
_refusals = RateLimitedLog(logger)  # a donor's poisoned state: once a minute
_outvoted = RateLimitedLog(logger)  # a donor whose state lost the vote: once a minute

DEFAULT_DOWNLOAD_TIMEOUT = 600.0
BUSY_BACKOFF, MAX_BUSY_BACKOFF = 0.05, 2.0
DEFAULT_VOTE_WINDOW = 2.0  # how long the other donors' manifests are awaited after the first usable one


class StateDownloadError(PeerError, RuntimeError):
    """Donors existed but none delivered the state; `failures` maps each donor tried to why."""

    def __init__(self, message: str, failures: dict[PeerID, str]):
        super().__init__(message)
        self.failures = failures


class StateDownloadTimeout(StateDownloadError, PhaseTimeout):
    """The deadline passed before the state was complete."""


@dataclass(frozen=True)
class Donor:
    """A peer that declared it shares state, with what it declared."""

    peer_id: PeerID
    priority: float
    addrs: tuple[Multiaddr, ...] = ()


def parse_declaration(subkey: Any, value: Any) -> Donor | None:
    """The donor one dictionary entry declares; None for a withdrawn (None) or malformed entry.

    Accepts ``(priority, [multiaddr bytes])`` and, from peers that declare no addresses, a bare priority.
    """
    if not isinstance(subkey, bytes):
        return None
    try:
        peer_id = PeerID(subkey)
    except ValueError:
        return None
    priority: Any = value
    raw_addrs: Any = ()
    if isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[1], (tuple, list)):
        priority, raw_addrs = value
    if isinstance(priority, bool) or not isinstance(priority, (int, float)) or not math.isfinite(priority):
        return None
    addrs = []
    for raw in raw_addrs[:MAX_DECLARED_ADDRS]:
        if isinstance(raw, bytes) and len(raw) <= MAX_ADDR_BYTES:
            try:
                addrs.append(Multiaddr.from_bytes(raw))
            except MultiaddrError:
                continue
    return Donor(peer_id, float(priority), tuple(addrs))


async def find_donors(
    dht_node: DHTNode,
    prefix: str,
    *,
    exclude: PeerID | None = None,
    min_priority: float | None = None,
    rng: random.Random | None = None,
) -> list[Donor]:
    """Donors declared under `prefix`, highest priority first, ties in random order."""
    rng = rng or random.Random()
    found = await dht_node.get(all_averagers_key(prefix), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    donors = [
        donor
        for subkey, item in found.value.items()
        if (donor := parse_declaration(subkey, item.value)) is not None
        and donor.peer_id != exclude
        and (min_priority is None or donor.priority >= min_priority)
    ]
    return sorted(donors, key=lambda donor: (-donor.priority, rng.random()))


class _DonorFailed(Exception):
    """The donor broke the protocol, sent a bad chunk or a bad manifest; not asked again."""


class _Refused(Exception):
    """The donor refused politely: `status` is BUSY, NOT_SHARING or UNKNOWN_SNAPSHOT."""

    def __init__(self, status: ReplyStatus, detail: str):
        super().__init__(f"{status.name}: {detail}" if detail else status.name)
        self.status = status


class _ChunkBoard:
    """Which distinct chunk hashes are missing, claimed by a worker, or in hand. No I/O."""

    def __init__(self, manifests: Iterable[StateManifest], have: dict[bytes, bytes]):
        self.have = have
        self.missing: dict[bytes, None] = {}  # unclaimed, in order (a dict keeps order and dedups)
        self.claimed: set[bytes] = set()
        for manifest in manifests:  # the states wanted: one, or every contender of a disputed vote
            for index in range(manifest.num_chunks):
                if (digest := manifest.chunk_hash(index)) not in have:
                    self.missing[digest] = None
        self.total = len(self.missing)  # distinct chunks this download still needed when it began
        self._changed = asyncio.Event()

    @property
    def complete(self) -> bool:
        return not self.missing and not self.claimed

    def claim(self, servable: dict[bytes, int], limit: int) -> list[bytes]:
        batch = []
        for digest in self.missing:
            if digest in servable:
                batch.append(digest)
                if len(batch) == limit:
                    break
        for digest in batch:
            del self.missing[digest]
            self.claimed.add(digest)
        return batch

    def holds(self, manifest: StateManifest) -> bool:
        """Every chunk of `manifest` is in hand."""
        return all(manifest.chunk_hash(index) in self.have for index in range(manifest.num_chunks))

    def can_help(self, servable: dict[bytes, int]) -> bool:
        return any(digest in servable for digest in self.missing) or any(d in servable for d in self.claimed)

    def deliver(self, digest: bytes, data: bytes) -> None:
        self.have[digest] = data
        self.claimed.discard(digest)
        self._notify()

    def release(self, digests: Iterable[bytes]) -> None:
        for digest in digests:
            if digest in self.claimed:
                self.claimed.discard(digest)
                self.missing[digest] = None
        self._notify()

    async def changed(self) -> None:
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


def _assemble(manifest: StateManifest, have: dict[bytes, bytes]) -> list[torch.Tensor]:
    """Cut the verified chunks back into tensor buffers and deserialize them (runs in a thread)."""
    chunks = [memoryview(have[manifest.chunk_hash(index)]) for index in range(manifest.num_chunks)]
    tensors, offset, size = [], 0, manifest.chunk_size
    for header in manifest.tensors:
        pieces, start, end = [], offset, offset + header.nbytes
        while start < end:
            index, within = divmod(start, size)
            take = min(size - within, end - start)
            pieces.append(chunks[index][within : within + take])
            start += take
        serialized = SerializedTensor(
            b"".join(pieces), header.size, header.dtype, header.compression, header.requires_grad
        )
        tensors.append(deserialize_torch_tensor(serialized))
        offset = end
    return tensors


def _stated_priority(donor: Donor, manifest: StateManifest) -> float:
    """What the donor's snapshot says about itself; the DHT declaration only for donors that predate that."""
    return donor.priority if manifest.priority is None else manifest.priority


def _priority_of(votes: Tally, key: bytes) -> float:
    return next(ballot.priority for ballot in votes.tier if ballot.key == key)


def _describe(error: BaseException, stall_timeout: float) -> str:
    if isinstance(error, TimeoutError):
        return f"made no progress for {stall_timeout} s"
    if isinstance(error, (_DonorFailed, _Refused)):
        return str(error)
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class _Download:
    """One `load_state_from_peers` call: its deadline, the chunks verified so far, and who failed."""

    def __init__(
        self,
        host: Host,
        prefix: str,
        deadline: float,
        stall_timeout: float,
        max_donors: int,
        batch_chunks: int,
        rng: random.Random,
        min_priority: float | None = None,
        reject_nonfinite: bool = True,
        vote_window: float = DEFAULT_VOTE_WINDOW,
    ):
        self.vote_window = vote_window
        self.host, self.prefix, self.deadline, self.stall_timeout = host, prefix, deadline, stall_timeout
        self.max_donors, self.batch_chunks, self.rng = max_donors, batch_chunks, rng
        self.min_priority, self.reject_nonfinite = min_priority, reject_nonfinite
        self.newest_refused: float | None = None  # the newest state refused as too old
        self.loop = asyncio.get_running_loop()
        self.have: dict[bytes, bytes] = {}  # verified chunks by SHA-256, kept across attempts
        self.failures: dict[PeerID, str] = {}  # donors not asked again, and why
        self.notes: dict[PeerID, str] = {}  # polite refusals (busy, not sharing), for the error message
        self.not_sharing: set[PeerID] = set()
        self.served: dict[PeerID, int] = {}
        self.board: _ChunkBoard | None = None
        self.incomplete_attempts = 0

    def _step_timeout(self) -> float:
        return max(0.0, min(self.stall_timeout, self.deadline - self.loop.time()))

    async def _read(self, stream, limit: int) -> bytes | None:
        async with asyncio.timeout(self._step_timeout()):
            frame = await rpc.read_frame(stream, limit)
        if frame is None:
            return None
        if frame[0] == rpc.ERROR:
            raise _DonorFailed(f"answered with an error: {frame[1].decode(errors='replace')}")
        return frame[1]

    async def _request(self, donor: Donor, request: StateRequest, reply_limit: int):
        """Open a stream, send `request`, read the reply header; returns (reply, stream)."""
        if donor.addrs:
            self.host.add_addrs(donor.peer_id, donor.addrs)
        async with asyncio.timeout(self._step_timeout()):
            stream = await self.host.new_stream(donor.peer_id, STATE_PROTOCOL, lazy=True)
        try:
            await rpc.write_frame(stream, request.encode())
            await stream.close()
            payload = await self._read(stream, reply_limit)
            if payload is None:
                raise _DonorFailed("closed the stream without a reply")
            try:
                reply = StateReply.decode(payload)
            except MessageError as error:
                raise _DonorFailed(f"sent a malformed reply: {error}") from None
            if reply.status != ReplyStatus.OK:
                raise _Refused(ReplyStatus(reply.status), reply.detail)
        except BaseException:
            stream.reset()
            raise
        return reply, stream

    async def fetch_manifest(self, donor: Donor) -> tuple[StateManifest, Any]:
        request = StateRequest(self.prefix, RequestKind.MANIFEST)
        reply, stream = await self._request(donor, request, MAX_REPLY_SIZE)
        stream.reset()  # everything we need has arrived
        if reply.manifest is None:
            raise _DonorFailed("answered a manifest request without a manifest")
        try:
            metadata = MSGPackSerializer.loads(reply.manifest.metadata, max_size=MAX_METADATA_SIZE)
        except SerializationError as error:
            raise _DonorFailed(f"sent metadata that does not unpack: {error}") from None
        return reply.manifest, metadata

    async def fetch_chunks(
        self, donor: Donor, manifest: StateManifest, indices: list[int], board: _ChunkBoard
    ) -> None:
        request = StateRequest(self.prefix, RequestKind.CHUNKS, manifest.snapshot_id, tuple(indices))
        _, stream = await self._request(donor, request, MAX_REQUEST_SIZE)
        try:
            for count, index in enumerate(indices):
                data = await self._read(stream, MAX_CHUNK_SIZE)
                if data is None:
                    raise _DonorFailed(f"closed the stream after {count} of {len(indices)} chunks")
                digest = manifest.chunk_hash(index)
                if len(data) != manifest.chunk_length(index) or hashlib.sha256(data).digest() != digest:
                    raise _DonorFailed(
                        f"sent chunk {index} whose SHA-256 does not match its own manifest "
                        f"(corrupted or tampered with)"
                    )
                board.deliver(digest, data)
                self.served[donor.peer_id] = self.served.get(donor.peer_id, 0) + 1
        finally:
            stream.reset()

    def _fail(self, donor: Donor, error: BaseException) -> None:
        reason = _describe(error, self.stall_timeout)
        if isinstance(error, _Refused) and error.status == ReplyStatus.NOT_SHARING:
            self.not_sharing.add(donor.peer_id)
            self.notes[donor.peer_id] = reason
        else:
            self.failures[donor.peer_id] = reason
        logger.debug(f"state donor {donor.peer_id} under {self.prefix!r}: {reason}")

    async def worker(self, donor: Donor, manifest: StateManifest, board: _ChunkBoard) -> None:
        """Fetch, from one donor, batches of the chunks it can serve until none is left for it."""
        servable = {manifest.chunk_hash(index): index for index in range(manifest.num_chunks)}
        backoff, refreshes = BUSY_BACKOFF, 0
        while not board.complete:
            batch = board.claim(servable, self.batch_chunks)
            if not batch:
                if not board.can_help(servable):
                    return
                await board.changed()
                continue
            try:
                await self.fetch_chunks(donor, manifest, [servable[digest] for digest in batch], board)
                backoff = BUSY_BACKOFF
            except _Refused as refusal:
                board.release(batch)
                if refusal.status == ReplyStatus.BUSY:
                    self.notes[donor.peer_id] = str(refusal)
                    await asyncio.sleep(backoff * (0.5 + self.rng.random()))  # a backoff, not synchronisation
                    backoff = min(2 * backoff, MAX_BUSY_BACKOFF)
                elif refusal.status == ReplyStatus.UNKNOWN_SNAPSHOT and refreshes < 2:
                    refreshes += 1  # the donor dropped our snapshot: whatever still matches, it can serve
                    try:
                        manifest, _ = await self.fetch_manifest(donor)
                    except Exception as error:
                        self._fail(donor, error)
                        return
                    servable = {manifest.chunk_hash(index): index for index in range(manifest.num_chunks)}
                else:
                    self._fail(donor, refusal)
                    return
            except BaseException as error:
                board.release(batch)
                if not isinstance(error, Exception):
                    raise
                self._fail(donor, error)
                return

    async def _first_manifests(
        self, manifests: dict[asyncio.Task, Donor]
    ) -> list[tuple[Donor, StateManifest, Any]]:
        """The manifests that arrive within one stall timeout, in the donors' order.

        The vote needs every donor asked, so this waits for all of them, unless the outcome can
        no longer change (`_settled`), but no longer than `vote_window` after the first usable
        manifest: a donor busy elsewhere (its training thread holding the state lock) must not
        hold the newcomer back for a whole stall timeout. Those still pending stay in `manifests`, to become helpers
        when they answer."""
        asked, answered, window_started = len(manifests), [], False
        wait_until = self.loop.time() + self._step_timeout()
        while manifests and (timeout := wait_until - self.loop.time()) > 0:
            done, _ = await asyncio.wait(manifests, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for task in [task for task in manifests if task in done]:  # keeps the donors' order
                donor = manifests.pop(task)
                try:
                    answered.append((donor, *task.result()))
                except Exception as error:
                    self._fail(donor, error)
                    continue
                priority = _stated_priority(donor, answered[-1][1])
                if not window_started and (self.min_priority is None or priority >= self.min_priority):
                    window_started = True  # a usable state is in: the others get `vote_window` more
                    wait_until = min(wait_until, self.loop.time() + self.vote_window)
            if self._settled(answered, asked, pending=len(manifests)):
                break
        return answered

    def _settled(self, answered: list, asked: int, pending: int) -> bool:
        """True when one state is held by more than half of the donors asked, at a priority no two
        other donors (answered ahead of it, or still pending) could outrank: no answer still to
        come can change the vote (see `state_vote`)."""
        groups: dict[bytes, tuple[float, int]] = {}
        for donor, manifest, _ in answered:
            priority = _stated_priority(donor, manifest)
            if self.min_priority is None or priority >= self.min_priority:
                key = content_key(manifest, priority)
                groups[key] = (priority, groups.get(key, (priority, 0))[1] + 1)
        for priority, count in groups.values():
            ahead = sum(_stated_priority(donor, manifest) > priority for donor, manifest, _ in answered)
            if 2 * count > asked and ahead + pending < 2:
                return True
        return False

    async def attempt(self, donors: list[Donor]) -> tuple[Any, list[torch.Tensor]] | None:
        """Download the state the donors asked vote for (`state_vote`); None if none is new enough
        (`min_priority`) or they could not deliver every chunk of any candidate."""
        candidates = [d for d in donors if self.may_ask(d)]
        manifests = {self.loop.create_task(self.fetch_manifest(d)): d for d in candidates[: self.max_donors]}
        workers: set[asyncio.Task] = set()
        try:
            answered = await self._first_manifests(manifests)
            if not answered:
                return None
            # what each donor states now counts, not what it declared (a declaration may lag a step)
            stated = {donor.peer_id: _stated_priority(donor, manifest) for donor, manifest, _ in answered}
            by_peer = {donor.peer_id: (donor, manifest, metadata) for donor, manifest, metadata in answered}
            ballots = [
                Ballot(peer, priority, content_key(by_peer[peer][1], priority))
                for peer, priority in stated.items()
                if self.min_priority is None or priority >= self.min_priority
            ]
            if not ballots:
                for peer, priority in stated.items():
                    self.notes[peer] = f"has state of priority {priority}, below {self.min_priority}"
                newest = max(stated.values())
                self.newest_refused = max(
                    newest, newest if self.newest_refused is None else self.newest_refused
                )
                self.incomplete_attempts += 1
                return None
            votes = tally(ballots, self.min_priority)
            keys = [votes.majority] if votes.majority is not None else votes.keys
            wanted = {key: by_peer[votes.supporters(key)[0]][1] for key in keys}
            older = self._older_states(votes, answered, stated)
            board = self.board = _ChunkBoard([*wanted.values(), *older.values()], self.have)
            self._log_plan(votes, wanted)
            for helper, helper_manifest, _ in answered:  # every donor serves the chunks its manifest lists
                workers.add(self.loop.create_task(self.worker(helper, helper_manifest, board)))
            pending = set(manifests) | workers
            while not board.complete and pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done & set(manifests):
                    helper = manifests.pop(task)
                    try:
                        helper_manifest, _ = task.result()
                    except Exception as error:
                        self._fail(helper, error)
                        continue
                    worker = self.loop.create_task(self.worker(helper, helper_manifest, board))
                    workers.add(worker)
                    pending.add(worker)
            contenders = await self._contenders(votes, wanted)
            if not contenders:
                self.incomplete_attempts += 1
                return None
            winner, reasons = (
                (contenders[0], {})
                if len(contenders) == 1
                else await asyncio.to_thread(judge, contenders, votes.credible)
            )
            references = await self._references(older) if older else []
            if (reason := await asyncio.to_thread(screen_alone, winner, references)) is not None:
                (peer,) = winner.supporters
                _outvoted.warning(
                    ("alone", peer), f"not adopting the state {self.prefix!r} of {peer}: {reason}"
                )
                self._fail(Donor(peer, winner.priority), _DonorFailed(f"refused: {reason}"))
                return None
            self._warn_outvoted(votes, winner, reasons)
            return self._metadata(winner, by_peer), list(winner.tensors)
        finally:
            leftovers = list(manifests) + list(workers)
            for task in leftovers:
                task.cancel()
            await asyncio.gather(*leftovers, return_exceptions=True)

    def _log_plan(self, votes: Tally, wanted: dict[bytes, StateManifest]) -> None:
        total = sum(manifest.total_bytes for manifest in wanted.values()) / 2**20
        if votes.majority is not None:
            supporters = votes.supporters(votes.majority)
            manifest = wanted[votes.majority]
            logger.info(
                f"downloading state {self.prefix!r} that {len(supporters)} of {len(votes.tier)} donors "
                f"agree on (priority {_priority_of(votes, votes.majority)}, first {supporters[0]}): "
                f"{total:.1f} MiB in {manifest.num_chunks} chunks, {len(self.have)} already in hand"
            )
        else:
            logger.info(
                f"the {len(votes.tier)} donors of state {self.prefix!r} at priority {votes.credible} or "
                f"above disagree: downloading their {len(wanted)} states ({total:.1f} MiB) to compare them"
            )

    @staticmethod
    def _older_states(
        votes: Tally, answered: list, stated: dict[PeerID, float]
    ) -> dict[bytes, StateManifest]:
        """For a state only one donor offers: the older states the other donors answered with
        (references for `screen_alone`), by content key; empty otherwise."""
        if len(votes.tier) != 1:
            return {}
        older: dict[bytes, StateManifest] = {}
        for donor, manifest, _ in answered:
            if donor.peer_id != votes.tier[0].peer_id:
                older.setdefault(content_key(manifest, stated[donor.peer_id]), manifest)
        return older

    async def _references(self, older: dict[bytes, StateManifest]) -> list[list[torch.Tensor]]:
        """The older states that arrived whole, decode and are finite (the others are no reference)."""
        references = []
        assert self.board is not None, "called once the chunks were fetched"
        for manifest in older.values():
            if not self.board.holds(manifest):
                continue
            try:
                tensors = await asyncio.to_thread(_assemble, manifest, self.have)
            except CompressionError:
                continue
            if first_nonfinite(tensors) is None:
                references.append(tensors)
        return references

    async def _contenders(self, votes: Tally, wanted: dict[bytes, StateManifest]) -> list[Contender]:
        """The wanted states that arrived whole, decode and hold no NaN or inf. A disputed state
        whose donors all failed in this call (a corrupt chunk, a dead stream) has no vote left."""
        contenders = []
        assert self.board is not None, "called once the chunks were fetched"
        for key, manifest in wanted.items():
            supporters = votes.supporters(key)
            alive = [peer for peer in supporters if peer not in self.failures]
            if not self.board.holds(manifest) or (votes.majority is None and not alive):
                continue
            try:
                tensors = await asyncio.to_thread(_assemble, manifest, self.have)
            except CompressionError as error:
                for peer in supporters:
                    self.failures[peer] = f"sent a manifest whose tensors do not decode: {error}"
                continue
            if self.reject_nonfinite and (bad := first_nonfinite(tensors)) is not None:
                for peer in supporters:
                    _refusals.warning(
                        ("nonfinite state", peer),
                        f"refusing the state {self.prefix!r} of {peer}: its tensor {bad} holds NaN or inf",
                    )
                    self.failures[peer] = f"sent a state whose tensor {bad} holds NaN or inf"
                continue
            contenders.append(Contender(key, _priority_of(votes, key), alive or supporters, tensors))
        return contenders

    def _warn_outvoted(self, votes: Tally, winner: Contender, reasons: dict[bytes, str]) -> None:
        """Name every donor of the tier whose state was not adopted, and why."""
        for ballot in votes.tier:
            if ballot.key == winner.key or ballot.peer_id in self.failures:
                continue
            if ballot.key in reasons:
                why = reasons[ballot.key]
            else:
                why = f"{len(votes.supporters(winner.key))} of the {len(votes.tier)} donors agree on another state"
            if ballot.priority > votes.credible + MAX_LEAD:
                why += (
                    f"; the priority it states, {ballot.priority}, is ahead of the others' ({votes.credible})"
                )
            self.notes[ballot.peer_id] = f"outvoted: {why}"
            _outvoted.warning(
                ("outvoted", ballot.peer_id),
                f"not adopting the state {self.prefix!r} of {ballot.peer_id} (outvoted): {why}",
            )

    @staticmethod
    def _metadata(winner: Contender, by_peer: dict[PeerID, tuple[Donor, StateManifest, Any]]) -> Any:
        """The metadata most of the winning state's donors sent (the first of them on a tie)."""
        counts: dict[bytes, int] = {}
        for peer in winner.supporters:
            raw = by_peer[peer][1].metadata
            counts[raw] = counts.get(raw, 0) + 1
        best = max(counts, key=counts.__getitem__)  # max keeps the first of equal counts
        return next(by_peer[peer][2] for peer in winner.supporters if by_peer[peer][1].metadata == best)

    def may_ask(self, donor: Donor) -> bool:
        return donor.peer_id not in self.failures and donor.peer_id not in self.not_sharing

    def summary(self) -> str:
        reasons = {**self.notes, **self.failures}
        return "; ".join(f"{peer}: {reason}" for peer, reason in reasons.items()) or "no donor answered"


async def stated_priority(host: Host, prefix: str, peer_id: PeerID, *, timeout: float) -> float | None:
    """The priority (e.g. the epoch) of the state `peer_id` would serve under `prefix` now, as its
    manifest states it; None when it does not share state there, breaks the protocol or does not
    answer within `timeout`. This is how a reader checks a peer's claim to be ahead of the swarm."""
    deadline = asyncio.get_running_loop().time() + timeout
    download = _Download(host, prefix, deadline, timeout, 1, 1, random.Random())
    try:
        async with asyncio.timeout(timeout):
            manifest, _ = await download.fetch_manifest(Donor(peer_id, 0.0))
    except Exception as error:  # unreachable, refusing, broken or too slow: the claim stays unconfirmed
        logger.debug(f"{peer_id} did not state the priority of its state under {prefix!r}: {error!r}")
        return None
    return manifest.priority


async def load_state_from_peers(
    host: Host,
    dht_node: DHTNode,
    prefix: str,
    *,
    timeout: float | None = None,
    max_attempts: int = 3,
    min_priority: float | None = None,
    max_donors: int = 4,
    stall_timeout: float = 30.0,
    batch_chunks: int = 8,
    rng: random.Random | None = None,
    reject_nonfinite: bool = True,
    vote_window: float = DEFAULT_VOTE_WINDOW,
) -> tuple[Any, list[torch.Tensor]] | None:
    """Download (metadata, tensors) from the peers sharing state under `prefix`.

    Args:
        timeout: the deadline for the whole call (None: DEFAULT_DOWNLOAD_TIMEOUT).
        max_attempts: rounds of (read the DHT, get manifests, fetch chunks); chunks verified in one
            round are kept for the next.
        min_priority: adopt no state older than this (e.g. the swarm's epoch), judged by the priority
            each donor states in its manifest, not by its possibly stale DHT declaration; when no
            donor has reached it, `StateDownloadError` says so.
        max_donors: donors asked for a manifest per round: the voters, and those fetched from in
            parallel.
        stall_timeout: the longest wait for any one reply or chunk before giving up on that donor.
        batch_chunks: chunks asked for per request (at most MAX_CHUNKS_PER_REQUEST).
        reject_nonfinite: refuse a state holding NaN or inf, and try the other donors.
        vote_window: seconds the other donors' manifests are awaited once one usable manifest is
            in (the vote is over those that answered by then; the rest only serve chunks).

    Returns:
        (metadata, tensors): CPU tensors in the donor's order, dtypes and shapes; or None when no
        peer declared it shares state under `prefix` (or every one said it no longer does), which
        is how the first peer of a run finds out it has nobody to learn from.

    Raises:
        StateDownloadError: donors existed but none delivered (names each and why).
        StateDownloadTimeout: the deadline passed first (says how far it got).
    """
    timeout = DEFAULT_DOWNLOAD_TIMEOUT if timeout is None else timeout
    if timeout <= 0 or max_attempts < 1 or max_donors < 1 or not 0 < batch_chunks <= MAX_CHUNKS_PER_REQUEST:
        raise ValueError(
            "timeout, max_attempts and max_donors must be positive, and batch_chunks "
            f"in [1, {MAX_CHUNKS_PER_REQUEST}]"
        )
    loop = asyncio.get_running_loop()
    started = loop.time()
    download = _Download(
        host,
        prefix,
        started + timeout,
        stall_timeout,
        max_donors,
        batch_chunks,
        rng or random.Random(),
        min_priority,
        reject_nonfinite,
        vote_window,
    )
    attempts = 0
    try:
        async with asyncio.timeout_at(download.deadline):
            for attempts in range(1, max_attempts + 1):  # noqa: B007 (read after the loop)
                # not filtered by min_priority: a declaration may lag a step behind the donor's state,
                # so the priority its manifest states is what counts (see `_Download.attempt`)
                donors = await find_donors(dht_node, prefix, exclude=host.peer_id, rng=download.rng)
                if not any(download.may_ask(donor) for donor in donors):
                    break
                result = await download.attempt(donors)
                if result is not None:
                    elapsed = loop.time() - started
                    served = ", ".join(f"{peer.short()}: {n}" for peer, n in download.served.items())
                    logger.info(
                        f"loaded state {prefix!r} in {elapsed:.2f} s (chunks per donor: {served or 'none'})"
                    )
                    return result
    except TimeoutError:
        board = download.board
        progress = (
            f"{board.total - len(board.missing) - len(board.claimed)} of {board.total} chunks"
            if board
            else "no manifest"
        )
        raise StateDownloadTimeout(
            f"loading state {prefix!r} did not finish within {timeout} s ({progress} verified; "
            f"{download.summary()}). Raise the timeout, or check that the donors are reachable.",
            dict(download.failures),
        ) from None
    if not download.failures and not download.incomplete_attempts:
        logger.info(f"no peer shares state under {prefix!r}; nothing to load")
        return None
    if download.newest_refused is not None:
        raise StateDownloadError(
            f"could not load state {prefix!r} of priority {download.min_priority} or newer after {attempts} "
            f"attempt(s): the newest state the donors that answered have is {download.newest_refused} "
            f"({download.summary()}). The donors may not have reached it yet: retry later.",
            dict(download.failures),
        )
    raise StateDownloadError(
        f"could not load state {prefix!r} after {attempts} attempt(s) in {loop.time() - started:.1f} s: "
        f"{download.summary()}. Check that the donors are online and reachable.",
        dict(download.failures),
    )
