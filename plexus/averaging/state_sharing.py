"""Donor side of state download: serve snapshots of this peer's state to newcomers.

Theory of operation
-------------------
A `StateSharing` declares its peer in the DHT under ``{prefix}.all_averagers`` (a dictionary:
subkey = peer id bytes, value = ``(priority, [multiaddr bytes])``, or None once it stops
sharing), every `declare_period` seconds and at once when its priority changes. The addresses
ride along so that a newcomer whose DHT never met the donor can still dial it. It serves
`STATE_PROTOCOL` (messages in `state_messages.py`) through one handler per host that dispatches
by prefix. The newcomer side is `state_download.py`.

A MANIFEST request gets a *snapshot* of the state as it is now: `get_current_state()` is called
in a worker thread under `state_lock`, and its tensors are copied before the lock is let go, so
whoever changes them under that lock (a training thread; the averager publishing a round) never
leaks into a snapshot, and a training thread holding the lock never stalls the event loop.
No lock is held across an await, so donors keep serving while they average. Serializing (with
`state_compression`) and hashing the copy happens in a worker thread. The newest snapshot is
reused, without a copy, only if the state read for this request is provably the same: the same
metadata, priority and tensor objects, none written since (torch counts in-place writes in a
tensor's version; writes through `.data` escape that count, which is what `snapshot_max_age`
bounds), and no `state_changed()` since. So a download made after the state changed gets the new
state. The manifest states the priority read together with the state, which newcomers trust over
the DHT declaration (that one may lag a step behind). Concurrent requests share one being built,
and later ones reuse it while the state stands still, so a crowd of newcomers costs one copy.
At most `MAX_SNAPSHOTS` are kept; one nobody has fetched from for `snapshot_retention` seconds is
dropped, and a new one replaces the least recently used (one with no upload in flight if there is
one); the downloaders of a replaced snapshot ask for a fresh manifest.
At most `max_concurrent_uploads` CHUNKS
requests are served at once; more get BUSY, and the newcomer backs off or fetches elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..compression import CompressionBase, CompressionInfo, NoCompression
from ..dht.node import DHTNode
from ..p2p import rpc
from ..p2p.host import Host
from ..utils.logging import get_logger
from ..utils.serializer import MSGPackSerializer
from ..utils.timing import get_dht_time
from .state_messages import (
    MAX_CHUNK_SIZE,
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
MAX_DECLARED_ADDRS = 8  # bounds of the DHT declaration, also enforced by newcomers reading it
MAX_ADDR_BYTES = 256
SHUTDOWN_DECLARE_TIMEOUT = 5.0
REQUEST_READ_TIMEOUT = 10.0  # a caller gets this long to send its one request frame


def all_averagers_key(prefix: str) -> str:
    return f"{prefix}.all_averagers"


@dataclass
class _Snapshot:
    manifest: StateManifest
    reply: bytes  # the encoded StateReply(OK, manifest), sent to every requester as is
    chunks: list  # memoryview or bytes per chunk
    created: float
    last_used: float
    version: int
    sources: list  # (weak reference, tensor version) of each tensor the copy was taken from
    uploads: int = 0  # CHUNKS requests being served from it


def _sources(tensors: Sequence[torch.Tensor]) -> list:
    return [(weakref.ref(tensor), tensor._version) for tensor in tensors]


def _same_tensors(sources: list, tensors: Sequence[torch.Tensor]) -> bool:
    """The very tensors a snapshot was copied from, not written to since (no id reuse: weak refs)."""
    return len(sources) == len(tensors) and all(
        ref() is tensor and version == tensor._version for (ref, version), tensor in zip(sources, tensors)
    )


def _serialize_snapshot(
    metadata: Any,
    tensors: Sequence[torch.Tensor],
    infos: Sequence[CompressionInfo | None],
    compression: CompressionBase,
    chunk_size: int,
    priority: float | None = None,
) -> tuple[StateManifest, list]:
    """Compress private copies of the tensors, cut their buffers into chunks, hash them (in a thread)."""
    metadata_bytes = MSGPackSerializer.dumps(metadata)
    headers, buffers = [], []
    for tensor, info in zip(tensors, infos):
        info = info or CompressionInfo.from_tensor(tensor)
        serialized = compression.compress(tensor, info, allow_inplace=True)
        headers.append(
            TensorHeader(
                serialized.size,
                serialized.dtype,
                int(serialized.compression),
                serialized.requires_grad,
                len(serialized.buffer),
            )
        )
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
    manifest = StateManifest(
        os.urandom(SNAPSHOT_ID_SIZE), metadata_bytes, tuple(headers), chunk_size, hashes, priority
    )
    return manifest, chunks


class _StateService:
    """The one `STATE_PROTOCOL` handler of a host, dispatching requests to sharers by prefix."""

    _by_host: ClassVar[weakref.WeakKeyDictionary[Host, _StateService]] = weakref.WeakKeyDictionary()

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
        get_current_state: returns (metadata, tensors) or (metadata, tensors, infos); called in a
            worker thread under `state_lock`. Metadata must be msgpack-serializable (tuples are
            kept). The tensors are copied right after it returns, before the lock is let go.
        state_lock: a context manager (e.g. the `threading.Lock` a training thread holds while it
            updates the tensors) held around the call and the copies, never across an await.
        state_compression: how tensors travel (any CompressionBase, adaptive ones included).
        priority: declared with the peer; newcomers prefer higher (e.g. the local epoch).
        allow_sharing: False declares None and answers NOT_SHARING.
        client_mode: a peer nobody can dial serves and declares nothing.
        snapshot_max_age: the oldest (seconds) a snapshot may be and still be reused for a state that
            looks unchanged; bounds what writes torch does not count (through `.data`) can hide.
        snapshot_retention: seconds after its last use that an unused snapshot is dropped.
    """

    def __init__(
        self,
        host: Host,
        dht_node: DHTNode,
        prefix: str,
        get_current_state: Callable[[], tuple],
        *,
        state_lock: contextlib.AbstractContextManager | None = None,
        state_compression: CompressionBase = NoCompression(),
        declare_period: float = 30.0,
        priority: float = 0.0,
        allow_sharing: bool = True,
        client_mode: bool = False,
        chunk_size_bytes: int = DEFAULT_CHUNK_SIZE,
        max_concurrent_uploads: int = 4,
        snapshot_max_age: float = 5.0,
        snapshot_retention: float = 30.0,
        upload_stall_timeout: float = 30.0,
    ):
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
        self._loop = loop = asyncio.get_running_loop()
        self._wakeup = wakeup = asyncio.Event()
        if not self.client_mode:
            _StateService.register(self.host, self)
            await self._declare()
            self._declarer = loop.create_task(self._declare_loop(wakeup))
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

    @property
    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The loop `start` ran on: all but `state_changed` runs there, once started."""
        if self._loop is None:
            raise RuntimeError("the state sharing has not started")
        return self._loop

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
                stored = await self.dht_node.store(
                    all_averagers_key(self.prefix), value, expiration, subkey=self.host.peer_id.to_bytes()
                )
            if not stored:
                logger.warning(
                    f"no DHT peer accepted our state-sharing declaration under {self.prefix!r}; "
                    f"retrying in {self.declare_period} s"
                )
        except (Exception, TimeoutError) as error:
            logger.warning(f"could not declare state sharing under {self.prefix!r} in the DHT: {error!r}")

    async def _declare_loop(self, wakeup: asyncio.Event) -> None:
        while True:
            try:  # a periodic refresh, woken early by a priority change
                async with asyncio.timeout(self.declare_period):
                    await wakeup.wait()
            except TimeoutError:
                pass
            wakeup.clear()
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
                logger.warning(
                    f"could not snapshot the state under {self.prefix!r}: {error!r}", exc_info=True
                )
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
        snapshot.uploads += 1
        try:
            await rpc.write_frame(stream, StateReply(ReplyStatus.OK).encode())
            for index in request.chunks:
                async with asyncio.timeout(self.upload_stall_timeout):
                    await rpc.write_frame(stream, self._chunk_payload(snapshot, index))
                snapshot.last_used = self._running_loop.time()
                self.chunks_served += 1
        finally:
            self._uploads -= 1
            snapshot.uploads -= 1

    def _chunk_payload(self, snapshot: _Snapshot, index: int):
        """The bytes sent for one chunk (a seam for tests that play a faulty donor)."""
        return snapshot.chunks[index]

    async def _current_snapshot(self) -> _Snapshot:
        self._drop_idle(self._running_loop.time())
        if self._building is None:
            self._building = self._running_loop.create_task(self._build_snapshot())
            # its waiters may all be gone by the time it fails: mark the error as seen, they log it
            self._building.add_done_callback(lambda task: task.cancelled() or task.exception())
        return await asyncio.shield(self._building)

    async def _build_snapshot(self) -> _Snapshot:
        try:
            # the consistency point: state and private copies are taken under the state lock, in a
            # worker thread, so a training thread holding that lock never stalls the event loop
            version = self._version
            newest = self._snapshots[-1] if self._snapshots else None
            if newest is not None and (
                newest.version != version
                or self._running_loop.time() - newest.created > self.snapshot_max_age
            ):
                newest = None
            taken = await asyncio.to_thread(self._take_state, newest)
            if taken is None:  # the state has not changed since the newest snapshot
                assert newest is not None  # (_take_state says so only of a snapshot it was given)
                newest.last_used = self._running_loop.time()
                return newest
            metadata, copies, infos, priority, sources = taken
            manifest, chunks = await asyncio.to_thread(
                _serialize_snapshot,
                metadata,
                copies,
                list(infos),
                self.state_compression,
                self.chunk_size,
                priority,
            )
            del copies
            now = self._running_loop.time()
            reply = StateReply(ReplyStatus.OK, manifest=manifest).encode()
            snapshot = _Snapshot(manifest, reply, chunks, now, now, version, sources)
            if len(self._snapshots) >= MAX_SNAPSHOTS:  # replace the least recently used, an idle one if any
                self._snapshots.remove(min(self._snapshots, key=lambda old: (old.uploads > 0, old.last_used)))
            self._snapshots.append(snapshot)
            self.snapshots_taken += 1
            self._schedule_sweep()
            return snapshot
        finally:
            self._building = None

    def _take_state(self, newest: _Snapshot | None) -> tuple | None:
        """(metadata, copies, infos, priority, sources), or None when the state read is the one
        `newest` was taken from. The priority is read with the state, so the manifest states the
        epoch of the tensors it describes, even if the DHT declaration still lags."""
        with self.state_lock:
            priority = self._priority
            state = self.get_current_state()
            metadata, tensors, infos = state if len(state) == 3 else (*state, [None] * len(state[1]))
            if (
                newest is not None
                and newest.manifest.priority == priority
                and newest.manifest.metadata == MSGPackSerializer.dumps(metadata)
                and _same_tensors(newest.sources, tensors)
            ):
                return None
            copies = [tensor.detach().to("cpu", copy=True) for tensor in tensors]
            return metadata, copies, infos, priority, _sources(tensors)

    def _drop_idle(self, now: float) -> None:
        self._snapshots = [s for s in self._snapshots if now - s.last_used < self.snapshot_retention]

    def _schedule_sweep(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._sweeper = None
        if self._snapshots:
            when = min(s.last_used for s in self._snapshots) + self.snapshot_retention
            self._sweeper = self._running_loop.call_at(when + 0.01, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        self._drop_idle(self._running_loop.time())
        self._schedule_sweep()

    def __repr__(self) -> str:
        state = "sharing" if self._allow_sharing and not self.client_mode else "not sharing"
        return (
            f"<StateSharing {self.prefix!r} {state} priority={self._priority} "
            f"snapshots={len(self._snapshots)} uploads={self._uploads}>"
        )


def _check_priority(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"priority must be a finite number, got {value!r}")
    return float(value)
