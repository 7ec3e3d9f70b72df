"""State download for newcomers: donors serve snapshots of their state, newcomers fetch and verify it.

Theory of operation
-------------------
Donors. A `StateSharing` declares its peer in the DHT under ``{prefix}.all_averagers`` (a
dictionary: subkey = peer id bytes, value = ``(priority, [multiaddr bytes])``, or None once it
stops sharing), every `declare_period` seconds and at once when its priority changes. The
addresses ride along so that a newcomer whose DHT never met the donor can still dial it. It
serves `STATE_PROTOCOL` through one handler per host that dispatches by prefix.

A MANIFEST request gets a *snapshot*: `get_current_state()` is called on the event loop and its
tensors are copied with torch ops before anything else can run on the loop, so an averaging
round that changes the tensors later (in place, on the loop) never leaks into it; a training
thread that changes them is kept out by `state_lock`, held for the call and the copies only.
No lock is held across an await, so donors keep serving while they average. Serializing (with
`state_compression`) and hashing the copy happens in a worker thread. A snapshot younger than
`snapshot_max_age` is reused unless the priority (the epoch) changed since, and concurrent
requests share one being built, so a crowd of newcomers costs one snapshot. At most
`MAX_SNAPSHOTS` are kept; one nobody has fetched from for `snapshot_retention` seconds is
dropped, and a newer one is never built by evicting one still in use (the newest is served
instead, a little stale). At most `max_concurrent_uploads` CHUNKS requests are served at once;
more get BUSY, and the newcomer backs off or fetches elsewhere.

Newcomers. `load_state_from_peers` reads the dictionary (latest), orders donors by priority
(ties at random), asks up to `max_donors` of them for manifests at once and takes the manifest
of the best one that answers as the reference. Every chunk is then a hash to fetch: a donor may
serve it when its own manifest lists the same hash (so donors with identical state all serve,
and identical chunks, e.g. zeros, are fetched once). One worker per donor claims batches of
chunks, verifies each against its SHA-256 and hands failed or corrupt batches back to the pool;
a donor that fails is not asked again in this call. An attempt ends when every chunk is in or
when no donor can serve what is missing; the next attempt re-reads the DHT and keeps every
chunk already verified. Everything runs under one deadline.

Results: (metadata, tensors); None when no donor declared itself (or all said they no longer
share); `StateDownloadError` naming every donor tried and why it failed otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import random
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ContextManager

import torch

from ..compression import CompressionBase, CompressionError, CompressionInfo, NoCompression, SerializedTensor
from ..compression import deserialize_torch_tensor
from ..dht.node import DHTNode
from ..p2p import rpc
from ..p2p.host import Host
from ..p2p.identity import PeerID
from ..p2p.messages import MessageError
from ..p2p.multiaddr import Multiaddr, MultiaddrError
from ..utils.logging import get_logger
from ..utils.serializer import MSGPackSerializer, SerializationError
from ..utils.timing import get_dht_time
from .state_messages import (
    HASH_SIZE,
    MAX_CHUNKS_PER_REQUEST,
    MAX_CHUNK_SIZE,
    MAX_METADATA_SIZE,
    MAX_REPLY_SIZE,
    MAX_REQUEST_SIZE,
    MIN_CHUNK_SIZE,
    SNAPSHOT_ID_SIZE,
    STATE_PROTOCOL,
    ReplyStatus,
    RequestKind,
    StateManifest,
    StateReply,
    StateRequest,
    TensorHeader,
)

logger = get_logger(__name__)

DEFAULT_CHUNK_SIZE = 1 << 20
MAX_SNAPSHOTS = 2
MAX_DECLARED_ADDRS = 8
MAX_ADDR_BYTES = 256
SHUTDOWN_DECLARE_TIMEOUT = 5.0
REQUEST_READ_TIMEOUT = 10.0  # a caller gets this long to send its one request frame
DEFAULT_DOWNLOAD_TIMEOUT = 600.0
BUSY_BACKOFF, MAX_BUSY_BACKOFF = 0.05, 2.0


def all_averagers_key(prefix: str) -> str:
    return f"{prefix}.all_averagers"


class StateDownloadError(RuntimeError):
    """Donors existed but none delivered the state; `failures` maps each donor tried to why."""

    def __init__(self, message: str, failures: dict[PeerID, str]):
        super().__init__(message)
        self.failures = failures


class StateDownloadTimeout(StateDownloadError, TimeoutError):
    """The deadline passed before the state was complete."""


# --- donors ------------------------------------------------------------------------------------


@dataclass
class _Snapshot:
    manifest: StateManifest
    reply: bytes  # the encoded StateReply(OK, manifest), sent to every requester as is
    chunks: list  # memoryview or bytes per chunk
    created: float
    last_used: float
    version: int


def _serialize_snapshot(metadata: Any, tensors: Sequence[torch.Tensor],
                        infos: Sequence[CompressionInfo | None], compression: CompressionBase,
                        chunk_size: int) -> tuple[StateManifest, list]:
    """Compress private copies of the tensors, cut their buffers into chunks, hash them (in a thread)."""
    metadata_bytes = MSGPackSerializer.dumps(metadata)
    headers, buffers = [], []
    for tensor, info in zip(tensors, infos):
        info = info or CompressionInfo.from_tensor(tensor)
        serialized = compression.compress(tensor, info, allow_inplace=True)
        headers.append(TensorHeader(serialized.size, serialized.dtype, int(serialized.compression),
                                    serialized.requires_grad, len(serialized.buffer)))
        buffers.append(serialized.buffer)
    chunks, pieces, filled = [], [], 0
    for buffer in buffers:  # chunks are views into the buffers; only chunks spanning two are joined
        view = memoryview(buffer)
        while view:
            take = min(chunk_size - filled, len(view))
            pieces.append(view[:take])
            view, filled = view[take:], filled + take
            if filled == chunk_size:
                chunks.append(pieces[0] if len(pieces) == 1 else b"".join(pieces))
                pieces, filled = [], 0
    if pieces:
        chunks.append(pieces[0] if len(pieces) == 1 else b"".join(pieces))
    hashes = b"".join(hashlib.sha256(chunk).digest() for chunk in chunks)
    manifest = StateManifest(os.urandom(SNAPSHOT_ID_SIZE), metadata_bytes, tuple(headers), chunk_size, hashes)
    return manifest, chunks


class _StateService:
    """The one `STATE_PROTOCOL` handler of a host, dispatching requests to sharers by prefix."""

    _by_host: weakref.WeakKeyDictionary[Host, _StateService] = weakref.WeakKeyDictionary()

    def __init__(self, host: Host):
        self.host = host
        self.sharers: dict[str, StateSharing] = {}

    @classmethod
    def register(cls, host: Host, sharer: StateSharing) -> None:
        service = cls._by_host.get(host)
        if service is None:
            service = cls._by_host[host] = cls(host)
            host.set_stream_handler(STATE_PROTOCOL, service.serve)
        if service.sharers.get(sharer.prefix, sharer) is not sharer:
            raise ValueError(f"this host already shares state under prefix {sharer.prefix!r}")
        service.sharers[sharer.prefix] = sharer

    @classmethod
    def unregister(cls, host: Host, sharer: StateSharing) -> None:
        service = cls._by_host.get(host)
        if service is not None and service.sharers.get(sharer.prefix) is sharer:
            del service.sharers[sharer.prefix]
            if not service.sharers:
                host.remove_stream_handler(STATE_PROTOCOL)
                del cls._by_host[host]

    async def serve(self, stream) -> None:
        try:
            try:
                async with asyncio.timeout(REQUEST_READ_TIMEOUT):
                    frame = await rpc.read_frame(stream, MAX_REQUEST_SIZE)
            except TimeoutError:
                raise ValueError(f"no request arrived within {REQUEST_READ_TIMEOUT} s") from None
            if frame is None or frame[0] != rpc.MESSAGE:
                raise ValueError("expected one StateRequest frame")
            request = StateRequest.decode(frame[1])
            sharer = self.sharers.get(request.prefix)
            if sharer is None:
                detail = f"no state is shared under prefix {request.prefix!r} on this peer"
                await rpc.write_frame(stream, StateReply(ReplyStatus.NOT_SHARING, detail).encode())
            else:
                await sharer._serve(request, stream)
        except (ValueError, rpc.RPCProtocolError) as error:  # MessageError is a ValueError
            logger.debug(f"bad state request from {stream.remote_peer}: {error}")
            message = f"bad state request: {error}".encode()[: rpc.MAX_ERROR_SIZE]
            await rpc.write_frame(stream, message, rpc.ERROR)
        except TimeoutError:  # the caller stopped reading: free the upload slot, drop the stream
            logger.debug(f"{stream.remote_peer} stalled a state download; dropping it")
            stream.reset()
            return
        await stream.close()


class StateSharing:
    """Serve snapshots of this peer's state to newcomers and declare it in the DHT.

    Args:
        get_current_state: returns (metadata, tensors) or (metadata, tensors, infos); called on
            the event loop thread, so it must be quick. Metadata must be msgpack-serializable
            (tuples are kept). The tensors are copied right after it returns, with no await between.
        state_lock: a context manager (e.g. the `threading.Lock` a training thread holds while it
            updates the tensors) held around the call and the copies, never across an await.
        state_compression: how tensors travel (any CompressionBase, adaptive ones included).
        priority: declared with the peer; newcomers prefer higher (e.g. the local epoch).
        allow_sharing: False declares None and answers NOT_SHARING.
        client_mode: a peer nobody can dial serves and declares nothing.
    """

    def __init__(self, host: Host, dht_node: DHTNode, prefix: str,
                 get_current_state: Callable[[], tuple], *, state_lock: ContextManager | None = None,
                 state_compression: CompressionBase = NoCompression(),
                 declare_period: float = 30.0, priority: float = 0.0, allow_sharing: bool = True,
                 client_mode: bool = False, chunk_size_bytes: int = DEFAULT_CHUNK_SIZE,
                 max_concurrent_uploads: int = 4, snapshot_max_age: float = 5.0,
                 snapshot_retention: float = 30.0, upload_stall_timeout: float = 30.0):
        if not MIN_CHUNK_SIZE <= chunk_size_bytes <= MAX_CHUNK_SIZE:
            raise ValueError(f"chunk_size_bytes must be in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]")
        if max_concurrent_uploads < 1 or declare_period <= 0:
            raise ValueError("max_concurrent_uploads must be >= 1 and declare_period > 0")
        self.host, self.dht_node, self.prefix = host, dht_node, prefix
        self.get_current_state, self.state_compression = get_current_state, state_compression
        self.state_lock = state_lock if state_lock is not None else contextlib.nullcontext()
        self.declare_period, self.client_mode, self.chunk_size = declare_period, client_mode, chunk_size_bytes
        self.max_concurrent_uploads, self.upload_stall_timeout = max_concurrent_uploads, upload_stall_timeout
        self.snapshot_max_age, self.snapshot_retention = snapshot_max_age, snapshot_retention
        self._priority, self._allow_sharing = _check_priority(priority), allow_sharing
        self._snapshots: list[_Snapshot] = []
        self._version = 0  # bumped when the priority changes: the state moved on, take a new snapshot
        self._building: asyncio.Task | None = None
        self._uploads = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._declarer: asyncio.Task | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self.snapshots_taken = self.chunks_served = self.busy_refusals = 0

    async def start(self) -> StateSharing:
        """Start serving and declare once (awaited, so newcomers can find us when this returns)."""
        self._loop, self._wakeup = asyncio.get_running_loop(), asyncio.Event()
        if not self.client_mode:
            _StateService.register(self.host, self)
            await self._declare()
            self._declarer = self._loop.create_task(self._declare_loop())
        return self

    async def shutdown(self) -> None:
        """Stop serving, withdraw the declaration (best effort) and drop the snapshots."""
        if self._declarer is not None:
            self._declarer.cancel()
            await asyncio.gather(self._declarer, return_exceptions=True)
            self._declarer = None
            self._allow_sharing = False
            await self._declare(timeout=min(self.declare_period, SHUTDOWN_DECLARE_TIMEOUT))
        _StateService.unregister(self.host, self)
        if self._building is not None:
            self._building.cancel()
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._snapshots.clear()

    @property
    def priority(self) -> float:
        return self._priority

    @priority.setter
    def priority(self, value: float) -> None:
        """Thread-safe; a change is declared right away."""
        value = _check_priority(value)
        if value != self._priority:
            self._priority = value
            self._version += 1
            self._wake()

    def state_changed(self) -> None:
        """The shared state changed (e.g. a round was applied): later requests get a new snapshot."""
        self._version += 1

    @property
    def allow_sharing(self) -> bool:
        return self._allow_sharing

    @allow_sharing.setter
    def allow_sharing(self, value: bool) -> None:
        if bool(value) != self._allow_sharing:
            self._allow_sharing = bool(value)
            self._wake()

    def _wake(self) -> None:
        if self._loop is None or self._wakeup is None:
            return
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._wakeup.set()
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wakeup.set)

    # --- declaring ---------------------------------------------------------------------------------

    async def _declare(self, timeout: float | None = None) -> None:
        if self._allow_sharing:
            addrs = [bytes(addr.to_bytes()) for addr in self.host.get_visible_maddrs()[:MAX_DECLARED_ADDRS]]
            value = (self._priority, addrs)
        else:
            value = None
        expiration = get_dht_time() + 2 * self.declare_period
        try:
            async with asyncio.timeout(timeout or self.declare_period):
                stored = await self.dht_node.store(all_averagers_key(self.prefix), value, expiration,
                                                   subkey=self.host.peer_id.to_bytes())
            if not stored:
                logger.warning(f"no DHT peer accepted our state-sharing declaration under {self.prefix!r}; "
                               f"retrying in {self.declare_period} s")
        except (Exception, TimeoutError) as error:
            logger.warning(f"could not declare state sharing under {self.prefix!r} in the DHT: {error!r}")

    async def _declare_loop(self) -> None:
        while True:
            try:  # a periodic refresh, woken early by a priority change
                async with asyncio.timeout(self.declare_period):
                    await self._wakeup.wait()
            except TimeoutError:
                pass
            self._wakeup.clear()
            await self._declare()

    # --- serving -----------------------------------------------------------------------------------

    async def _serve(self, request: StateRequest, stream) -> None:
        if not self._allow_sharing:
            detail = f"this peer no longer shares state under {self.prefix!r}"
            await rpc.write_frame(stream, StateReply(ReplyStatus.NOT_SHARING, detail).encode())
        elif request.kind == RequestKind.MANIFEST:
            try:
                snapshot = await self._current_snapshot()
            except Exception as error:
                logger.warning(f"could not snapshot the state under {self.prefix!r}: {error!r}",
                               exc_info=True)
                raise ValueError(f"the donor failed to snapshot its state: {error!r}") from None
            await rpc.write_frame(stream, snapshot.reply)
        else:
            await self._serve_chunks(request, stream)

    async def _serve_chunks(self, request: StateRequest, stream) -> None:
        snapshot = next((s for s in self._snapshots if s.manifest.snapshot_id == request.snapshot_id), None)
        if snapshot is None:
            detail = "that snapshot was dropped; ask for a new manifest"
            reply = StateReply(ReplyStatus.UNKNOWN_SNAPSHOT, detail)
            await rpc.write_frame(stream, reply.encode())
            return
        if any(index >= len(snapshot.chunks) for index in request.chunks):
            raise ValueError(f"chunk index out of range: the snapshot has {len(snapshot.chunks)} chunks")
        if self._uploads >= self.max_concurrent_uploads:
            self.busy_refusals += 1
            detail = f"{self._uploads} downloads in flight, the limit is {self.max_concurrent_uploads}"
            await rpc.write_frame(stream, StateReply(ReplyStatus.BUSY, detail).encode())
            return
        self._uploads += 1
        try:
            await rpc.write_frame(stream, StateReply(ReplyStatus.OK).encode())
            for index in request.chunks:
                async with asyncio.timeout(self.upload_stall_timeout):
                    await rpc.write_frame(stream, self._chunk_payload(snapshot, index))
                snapshot.last_used = self._loop.time()
                self.chunks_served += 1
        finally:
            self._uploads -= 1

    def _chunk_payload(self, snapshot: _Snapshot, index: int):
        """The bytes sent for one chunk (a seam for tests that play a faulty donor)."""
        return snapshot.chunks[index]

    async def _current_snapshot(self) -> _Snapshot:
        now = self._loop.time()
        self._drop_idle(now)
        if self._snapshots:
            newest = self._snapshots[-1]
            fresh = now - newest.created <= self.snapshot_max_age and newest.version == self._version
            if fresh or len(self._snapshots) >= MAX_SNAPSHOTS:
                newest.last_used = now
                return newest
        if self._building is None:
            self._building = self._loop.create_task(self._build_snapshot())
            # its waiters may all be gone by the time it fails: mark the error as seen, they log it
            self._building.add_done_callback(lambda task: task.cancelled() or task.exception())
        return await asyncio.shield(self._building)

    async def _build_snapshot(self) -> _Snapshot:
        try:
            # the consistency point: state and private copies are taken under the state lock, in a
            # worker thread, so a training thread holding that lock never stalls the event loop
            version = self._version
            metadata, copies, infos = await asyncio.to_thread(self._take_state)
            manifest, chunks = await asyncio.to_thread(
                _serialize_snapshot, metadata, copies, list(infos), self.state_compression, self.chunk_size)
            del copies
            now = self._loop.time()
            reply = StateReply(ReplyStatus.OK, manifest=manifest).encode()
            snapshot = _Snapshot(manifest, reply, chunks, now, now, version)
            self._snapshots.append(snapshot)
            self.snapshots_taken += 1
            self._schedule_sweep()
            return snapshot
        finally:
            self._building = None

    def _take_state(self) -> tuple:
        with self.state_lock:
            state = self.get_current_state()
            metadata, tensors, infos = state if len(state) == 3 else (*state, [None] * len(state[1]))
            return metadata, [tensor.detach().to("cpu", copy=True) for tensor in tensors], infos

    def _drop_idle(self, now: float) -> None:
        self._snapshots = [s for s in self._snapshots if now - s.last_used < self.snapshot_retention]

    def _schedule_sweep(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._sweeper = None
        if self._snapshots:
            when = min(s.last_used for s in self._snapshots) + self.snapshot_retention
            self._sweeper = self._loop.call_at(when + 0.01, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        self._drop_idle(self._loop.time())
        self._schedule_sweep()

    def __repr__(self) -> str:
        state = "sharing" if self._allow_sharing and not self.client_mode else "not sharing"
        return (f"<StateSharing {self.prefix!r} {state} priority={self._priority} "
                f"snapshots={len(self._snapshots)} uploads={self._uploads}>")


def _check_priority(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"priority must be a finite number, got {value!r}")
    return float(value)


# --- newcomers ---------------------------------------------------------------------------------


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
    priority, raw_addrs = value, ()
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


async def find_donors(dht_node: DHTNode, prefix: str, *, exclude: PeerID | None = None,
                      min_priority: float | None = None, rng: random.Random | None = None) -> list[Donor]:
    """Donors declared under `prefix`, highest priority first, ties in random order."""
    rng = rng or random.Random()
    found = await dht_node.get(all_averagers_key(prefix), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    donors = [donor for subkey, item in found.value.items()
              if (donor := parse_declaration(subkey, item.value)) is not None and donor.peer_id != exclude
              and (min_priority is None or donor.priority >= min_priority)]
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

    def __init__(self, manifest: StateManifest, have: dict[bytes, bytes]):
        self.have = have
        self.missing: dict[bytes, None] = {}  # unclaimed, in order (a dict keeps order and dedups)
        self.claimed: set[bytes] = set()
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
        serialized = SerializedTensor(b"".join(pieces), header.size, header.dtype, header.compression,
                                      header.requires_grad)
        tensors.append(deserialize_torch_tensor(serialized))
        offset = end
    return tensors


def _describe(error: BaseException, stall_timeout: float) -> str:
    if isinstance(error, TimeoutError):
        return f"made no progress for {stall_timeout} s"
    if isinstance(error, (_DonorFailed, _Refused)):
        return str(error)
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class _Download:
    """One `load_state_from_peers` call: its deadline, the chunks verified so far, and who failed."""

    def __init__(self, host: Host, prefix: str, deadline: float, stall_timeout: float, max_donors: int,
                 batch_chunks: int, rng: random.Random):
        self.host, self.prefix, self.deadline, self.stall_timeout = host, prefix, deadline, stall_timeout
        self.max_donors, self.batch_chunks, self.rng = max_donors, batch_chunks, rng
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

    async def fetch_chunks(self, donor: Donor, manifest: StateManifest, indices: list[int],
                           board: _ChunkBoard) -> None:
        request = StateRequest(self.prefix, RequestKind.CHUNKS, manifest.snapshot_id, tuple(indices))
        _, stream = await self._request(donor, request, MAX_REQUEST_SIZE)
        try:
            for count, index in enumerate(indices):
                data = await self._read(stream, MAX_CHUNK_SIZE)
                if data is None:
                    raise _DonorFailed(f"closed the stream after {count} of {len(indices)} chunks")
                digest = manifest.chunk_hash(index)
                if len(data) != manifest.chunk_length(index) or hashlib.sha256(data).digest() != digest:
                    raise _DonorFailed(f"sent chunk {index} whose SHA-256 does not match its own manifest "
                                       f"(corrupted or tampered with)")
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

    async def attempt(self, donors: list[Donor]) -> tuple[Any, list[torch.Tensor]] | None:
        """Download from the best donors that answer; None if they could not deliver every chunk."""
        candidates = [d for d in donors if self.may_ask(d)]
        manifests = {self.loop.create_task(self.fetch_manifest(d)): d for d in candidates[: self.max_donors]}
        workers: set[asyncio.Task] = set()
        try:
            reference = None
            for task, donor in list(manifests.items()):  # the best donor that answers is the reference
                del manifests[task]
                try:
                    reference = (donor, *await task)
                    break
                except Exception as error:
                    self._fail(donor, error)
            if reference is None:
                return None
            donor, manifest, metadata = reference
            board = self.board = _ChunkBoard(manifest, self.have)
            logger.info(f"downloading state {self.prefix!r} from {donor.peer_id} "
                        f"(priority {donor.priority}): {manifest.total_bytes / 2**20:.1f} MiB "
                        f"in {manifest.num_chunks} chunks, {len(self.have)} already in hand")
            workers.add(self.loop.create_task(self.worker(donor, manifest, board)))
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
            if not board.complete:
                self.incomplete_attempts += 1
                return None
            try:
                tensors = await asyncio.to_thread(_assemble, manifest, self.have)
            except CompressionError as error:
                self._fail(donor, _DonorFailed(f"sent a manifest whose tensors do not decode: {error}"))
                return None
            return metadata, tensors
        finally:
            leftovers = list(manifests) + list(workers)
            for task in leftovers:
                task.cancel()
            await asyncio.gather(*leftovers, return_exceptions=True)

    def may_ask(self, donor: Donor) -> bool:
        return donor.peer_id not in self.failures and donor.peer_id not in self.not_sharing

    def summary(self) -> str:
        reasons = {**self.notes, **self.failures}
        return "; ".join(f"{peer}: {reason}" for peer, reason in reasons.items()) or "no donor answered"


async def load_state_from_peers(host: Host, dht_node: DHTNode, prefix: str, *, timeout: float | None = None,
                                max_attempts: int = 3, min_priority: float | None = None, max_donors: int = 4,
                                stall_timeout: float = 30.0, batch_chunks: int = 8,
                                rng: random.Random | None = None) -> tuple[Any, list[torch.Tensor]] | None:
    """Download (metadata, tensors) from the peers sharing state under `prefix`.

    Args:
        timeout: the deadline for the whole call (None: DEFAULT_DOWNLOAD_TIMEOUT).
        max_attempts: rounds of (read the DHT, get manifests, fetch chunks); chunks verified in one
            round are kept for the next.
        min_priority: ignore donors that declared a lower priority (e.g. an older epoch).
        max_donors: donors asked for a manifest, and so fetched from in parallel, per round.
        stall_timeout: the longest wait for any one reply or chunk before giving up on that donor.
        batch_chunks: chunks asked for per request (at most MAX_CHUNKS_PER_REQUEST).

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
        raise ValueError("timeout, max_attempts and max_donors must be positive, and batch_chunks "
                         f"in [1, {MAX_CHUNKS_PER_REQUEST}]")
    loop = asyncio.get_running_loop()
    started = loop.time()
    download = _Download(host, prefix, started + timeout, stall_timeout, max_donors, batch_chunks,
                         rng or random.Random())
    attempts = 0
    try:
        async with asyncio.timeout_at(download.deadline):
            for attempts in range(1, max_attempts + 1):
                donors = await find_donors(dht_node, prefix, exclude=host.peer_id, min_priority=min_priority,
                                           rng=download.rng)
                if not any(download.may_ask(donor) for donor in donors):
                    break
                result = await download.attempt(donors)
                if result is not None:
                    elapsed = loop.time() - started
                    served = ", ".join(f"{peer.short()}: {n}" for peer, n in download.served.items())
                    logger.info(f"loaded state {prefix!r} in {elapsed:.2f} s "
                                f"(chunks per donor: {served or 'none'})")
                    return result
    except TimeoutError:
        board = download.board
        progress = (f"{board.total - len(board.missing) - len(board.claimed)} of {board.total} chunks"
                    if board else "no manifest")
        raise StateDownloadTimeout(
            f"loading state {prefix!r} did not finish within {timeout} s ({progress} verified; "
            f"{download.summary()}). Raise the timeout, or check that the donors are reachable.",
            dict(download.failures)) from None
    if not download.failures and not download.incomplete_attempts:
        logger.info(f"no peer shares state under {prefix!r}; nothing to load")
        return None
    raise StateDownloadError(
        f"could not load state {prefix!r} after {attempts} attempt(s) in {loop.time() - started:.1f} s: "
        f"{download.summary()}. Check that the donors are online and reachable.", dict(download.failures))
