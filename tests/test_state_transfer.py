"""State download for newcomers over real hosts and DHT nodes on 127.0.0.1, all in one event loop."""

import asyncio
import contextlib
import hashlib
import random
import threading
import time

import msgpack
import pytest
import torch

from plexus.averaging.state_download import (
    StateDownloadError,
    StateDownloadTimeout,
    _ChunkBoard,
    find_donors,
    load_state_from_peers,
    parse_declaration,
)
from plexus.averaging.state_messages import (
    HASH_SIZE,
    STATE_PROTOCOL,
    ReplyStatus,
    RequestKind,
    StateManifest,
    StateReply,
    StateRequest,
    TensorHeader,
)
from plexus.averaging.state_sharing import MAX_SNAPSHOTS, StateSharing
from plexus.compression import Float16Compression
from plexus.dht.node import DHTNode
from plexus.dht.p2p_transport import HostDHTTransport
from plexus.p2p import rpc
from plexus.p2p.host import Host
from plexus.p2p.messages import MessageError

pytestmark = pytest.mark.timeout(60)
PREFIX = "test_run"
CHUNK = 64 << 10


def run(coroutine, timeout: float = 30):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


class Peer:
    def __init__(self, host: Host, node: DHTNode):
        self.host, self.node = host, node

    async def close(self):
        await self.node.shutdown()
        await self.host.shutdown()


async def make_peer(bootstrap: "Peer | None" = None) -> Peer:
    host = await Host(host_maddrs=("/ip4/127.0.0.1/tcp/0",)).start()
    initial = []
    if bootstrap is not None:
        await host.connect(bootstrap.host.get_visible_maddrs()[0])
        initial = [bootstrap.host.peer_id]
    node = await DHTNode.create(initial_peers=initial, rpc=HostDHTTransport(host), wait_timeout=1.0)
    return Peer(host, node)


@contextlib.asynccontextmanager
async def swarm(n: int):
    peers = [await make_peer()]
    for _ in range(n - 1):
        peers.append(await make_peer(peers[0]))
    try:
        yield peers
    finally:
        for peer in peers:
            await peer.close()


def make_state(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randn(512, 1024, generator=generator),  # 2 MiB
        torch.randn(300, 500, generator=generator).to(torch.bfloat16),
        torch.randn(1000, generator=generator).to(torch.float16),
        torch.randint(-(2**40), 2**40, (777,), generator=generator),
        torch.rand(33, generator=generator) > 0.5,
        torch.tensor(3.5, dtype=torch.float64),
        torch.zeros(0, 4),
        torch.zeros(70_000),  # two identical all-zero chunks: fetched once
    ]
    metadata = {"epoch": 7 + seed, "group_bits": "0101", "nested": (1, 2, [3.5, None]), "blob": b"\x00\xff"}
    return metadata, tensors


def assert_same(expected, got):
    assert len(expected) == len(got)
    for a, b in zip(expected, got):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


async def load(peer: Peer, prefix: str = PREFIX, **kwargs):
    return await load_state_from_peers(peer.host, peer.node, prefix, **{"timeout": 20, **kwargs})


async def share(peer: Peer, state, **kwargs) -> StateSharing:
    kwargs.setdefault("chunk_size_bytes", CHUNK)
    return await StateSharing(peer.host, peer.node, PREFIX, lambda: state, **kwargs).start()


def test_newcomer_downloads_exact_state_and_metadata():
    async def main():
        async with swarm(2) as (donor, newcomer):
            metadata, tensors = make_state()
            sharing = await share(donor, (metadata, tensors), priority=3)
            started = time.perf_counter()
            loaded_metadata, loaded = await load(newcomer)
            elapsed = time.perf_counter() - started
            assert loaded_metadata == metadata and isinstance(loaded_metadata["nested"], tuple)
            assert_same(tensors, loaded)
            assert sharing.snapshots_taken == 1 and sharing.chunks_served > 0
            assert elapsed < 10
            await sharing.shutdown()

    run(main())


def test_two_donors_with_identical_state_both_serve_chunks():
    async def main():
        async with swarm(3) as (a, b, newcomer):
            metadata, tensors = make_state()
            shared = [await share(peer, (metadata, tensors), priority=1) for peer in (a, b)]
            # whichever donor the newcomer starts with holds its first batch until the other one has served a
            # chunk, so the test does not depend on which manifest arrives first
            served, first = {s: asyncio.Event() for s in shared}, []
            for s in shared:
                other = shared[1 - shared.index(s)]
                serve_chunks, serve_payload = s._serve_chunks, s._chunk_payload

                async def gated(request, stream, other=other, serve_chunks=serve_chunks):
                    if not first:
                        first.append(request)
                        await asyncio.wait_for(served[other].wait(), 10)
                    return await serve_chunks(request, stream)

                def payload(snapshot, index, s=s, serve_payload=serve_payload):
                    served[s].set()
                    return serve_payload(snapshot, index)

                s._serve_chunks, s._chunk_payload = gated, payload
            _, loaded = await load(newcomer, batch_chunks=4)
            assert_same(tensors, loaded)
            assert all(s.chunks_served > 0 for s in shared), [s.chunks_served for s in shared]
            for s in shared:
                await s.shutdown()

    run(main())


def test_state_changing_during_a_download_yields_the_snapshot():
    async def main():
        async with swarm(3) as (donor, first, second):
            metadata, tensors = make_state()
            original = [t.clone() for t in tensors]
            lock, entered = threading.Lock(), []

            class TrainingLock:  # what a training thread holds while it updates the tensors
                def __enter__(self):
                    lock.acquire()
                    entered.append(1)

                def __exit__(self, *exc_info):
                    lock.release()

            sharing = await share(donor, (metadata, tensors), state_lock=TrainingLock(), priority=7)
            serve = StateSharing._chunk_payload

            def averaging_round_midway(snapshot, index):  # an averaging round lands between two chunks
                if sharing.chunks_served == 2:
                    for tensor in tensors:
                        if tensor.dtype.is_floating_point and tensor.numel():
                            tensor.add_(1)
                    metadata["epoch"] += 1
                return serve(sharing, snapshot, index)

            sharing._chunk_payload = averaging_round_midway
            loaded_metadata, loaded = await load(first)
            assert loaded_metadata["epoch"] == 7
            assert_same(original, loaded)
            assert not torch.equal(tensors[0], original[0])  # the live state did change meanwhile
            # the donor's epoch moved on: a later newcomer gets a fresh snapshot with the new values
            sharing.priority = 8
            loaded_metadata, loaded = await load(second)
            assert loaded_metadata["epoch"] == 8
            assert_same(tensors, loaded)
            assert sharing.snapshots_taken == len(entered) == 2 and not lock.locked()
            await sharing.shutdown()

    run(main())


def test_donor_dying_mid_download_newcomer_finishes_from_another():
    async def main():
        async with swarm(4) as (_boot, a, b, newcomer):
            metadata, tensors = make_state()
            dying = await share(a, (metadata, tensors), priority=2)
            healthy = await share(b, (metadata, tensors), priority=1)
            serve = StateSharing._chunk_payload
            dead = []

            def die_after_first_chunk(snapshot, index):
                if not dead:
                    dead.append(asyncio.get_running_loop().create_task(a.host.shutdown()))
                return serve(dying, snapshot, index)

            dying._chunk_payload = die_after_first_chunk
            _, loaded = await load(newcomer, batch_chunks=4)
            assert_same(tensors, loaded)
            assert dead and healthy.chunks_served > 0
            await healthy.shutdown()

    run(main())


def test_best_donor_dying_falls_back_to_a_donor_with_other_state():
    async def main():
        async with swarm(4) as (_boot, a, b, newcomer):
            fresh, stale = make_state(0), make_state(1)
            dying = await share(a, fresh, priority=2)
            older = await share(b, stale, priority=1)
            serve = StateSharing._chunk_payload

            def die(snapshot, index):
                if dying.chunks_served == 1:
                    asyncio.get_running_loop().create_task(a.host.shutdown())
                return serve(dying, snapshot, index)

            dying._chunk_payload = die
            metadata, loaded = await load(newcomer)
            assert metadata == stale[0]
            assert_same(stale[1], loaded)
            await older.shutdown()

    run(main())


def test_corrupt_chunks_are_detected_and_refetched_elsewhere():
    async def main():
        async with swarm(3) as (a, b, newcomer):
            metadata, tensors = make_state()
            liar = await share(a, (metadata, tensors), priority=2)
            honest = await share(b, (metadata, tensors), priority=1)
            serve = StateSharing._chunk_payload

            def flip_a_byte(snapshot, index):
                data = bytearray(serve(liar, snapshot, index))
                data[len(data) // 2] ^= 0x01
                return bytes(data)

            liar._chunk_payload = flip_a_byte
            _, loaded = await load(newcomer)
            assert_same(tensors, loaded)
            assert liar.chunks_served >= 1 and honest.chunks_served > 0
            await liar.shutdown()
            await honest.shutdown()

    run(main())


def test_no_donors_returns_none():
    async def main():
        async with swarm(3) as (a, _b, newcomer):
            assert await load(newcomer, timeout=10) is None
            # a peer that declared but no longer shares counts as no donor too
            metadata, tensors = make_state()
            sharing = await share(a, (metadata, tensors), allow_sharing=False)
            assert await load(newcomer, timeout=10) is None
            await sharing.shutdown()

    run(main())


def test_all_donors_failing_gives_a_clear_error_within_the_deadline():
    async def main():
        async with swarm(4) as (_boot, a, b, newcomer):
            metadata, tensors = make_state()
            liars = [await share(a, (metadata, tensors)), await share(b, (metadata, tensors))]
            serve = StateSharing._chunk_payload
            for liar in liars:

                def zero_first_byte(snapshot, index, liar=liar):
                    return b"\x00" + bytes(serve(liar, snapshot, index))[1:]

                liar._chunk_payload = zero_first_byte
            started = time.perf_counter()
            with pytest.raises(StateDownloadError) as caught:
                await load(newcomer, timeout=10, max_attempts=5)
            assert time.perf_counter() - started < 10
            message = str(caught.value)
            assert "SHA-256" in message and str(a.host.peer_id) in message and str(b.host.peer_id) in message
            assert set(caught.value.failures) == {a.host.peer_id, b.host.peer_id}
            manifests_served = sum(liar.snapshots_taken for liar in liars)
            assert manifests_served == 2  # each liar was asked once, then never again

            # donors that are gone but still listed in the DHT: refused connections, named, bounded
            await a.host.shutdown()
            await b.host.shutdown()
            started = time.perf_counter()
            with pytest.raises(StateDownloadError, match="could not load state") as caught:
                await load(newcomer, timeout=10, max_attempts=5)
            assert time.perf_counter() - started < 10
            assert set(caught.value.failures) == {a.host.peer_id, b.host.peer_id}

    run(main())


def test_stalled_donors_end_in_a_timeout_or_a_stall_error_never_a_hang():
    async def main():
        async with swarm(2) as (donor, newcomer):
            metadata, tensors = make_state()
            sharing = await share(donor, (metadata, tensors))
            never = asyncio.Event()

            async def stall(request, stream):
                await never.wait()

            sharing._serve_chunks = stall
            started = time.perf_counter()
            with pytest.raises(StateDownloadTimeout, match=r"within 1.0 s \(0 of 39 chunks verified"):
                await load(newcomer, timeout=1.0)
            assert time.perf_counter() - started < 3
            started = time.perf_counter()
            with pytest.raises(StateDownloadError, match="made no progress for 0.3 s") as caught:
                await load(newcomer, timeout=10, stall_timeout=0.3)
            assert not isinstance(caught.value, StateDownloadTimeout)
            assert time.perf_counter() - started < 3
            await sharing.shutdown()

    run(main())


def test_a_dropped_snapshot_is_replaced_and_the_download_goes_on():
    async def main():
        async with swarm(2) as (donor, newcomer):
            metadata, tensors = make_state()
            sharing = await share(donor, (metadata, tensors))
            serve_chunks = sharing._serve_chunks

            async def forget_once(request, stream):
                if sharing.snapshots_taken == 1:
                    sharing._snapshots.clear()  # as if it expired between the manifest and the chunks
                return await serve_chunks(request, stream)

            sharing._serve_chunks = forget_once
            _, loaded = await load(newcomer)
            assert_same(tensors, loaded)
            assert sharing.snapshots_taken == 2
            await sharing.shutdown()

    run(main())


def test_metadata_only_state():
    async def main():
        async with swarm(2) as (donor, newcomer):
            sharing = await share(donor, ({"step": 1}, []))
            assert await load(newcomer, timeout=10) == ({"step": 1}, [])
            await sharing.shutdown()

    run(main())


def test_float16_state_compression_round_trip():
    async def main():
        async with swarm(2) as (donor, newcomer):
            metadata, tensors = make_state()
            sharing = await share(donor, (metadata, tensors), state_compression=Float16Compression())
            _, loaded = await load(newcomer)
            for a, b in zip(tensors, loaded):
                assert a.dtype == b.dtype and a.shape == b.shape
                if a.dtype.is_floating_point:
                    torch.testing.assert_close(b.float(), a.float(), rtol=1e-2, atol=1e-3)
                else:
                    assert torch.equal(a, b)
            assert sharing.chunks_served < 30  # fewer bytes went over the wire than uncompressed
            await sharing.shutdown()

    run(main())


def test_garbage_requests_get_errors_and_the_donor_keeps_serving():
    async def main():
        async with swarm(2) as (donor, newcomer):
            metadata, tensors = make_state()
            sharing = await share(donor, (metadata, tensors))

            async def ask(payload: bytes, kind: int = rpc.MESSAGE) -> list:
                stream = await newcomer.host.new_stream(donor.host.peer_id, STATE_PROTOCOL, lazy=True)
                await rpc.write_frame(stream, payload, kind)
                await stream.close()
                frames = []
                while (frame := await rpc.read_frame(stream, 64 << 20)) is not None:
                    frames.append(frame)
                return frames

            for garbage in (b"", b"\xff\x00garbage", b"\x93\x01\x02\x03", StateRequest("x", 0).encode()[:-1]):
                ((kind, text),) = await ask(garbage)
                assert kind == rpc.ERROR and b"bad state request" in text
            ((kind, _),) = await ask(b"an error frame as a request", rpc.ERROR)
            assert kind == rpc.ERROR
            ((kind, payload),) = await ask(StateRequest("other_prefix", RequestKind.MANIFEST).encode())
            assert StateReply.decode(payload).status == ReplyStatus.NOT_SHARING
            chunks = StateRequest(PREFIX, RequestKind.CHUNKS, b"s" * 16, (0,))
            ((kind, payload),) = await ask(chunks.encode())
            assert StateReply.decode(payload).status == ReplyStatus.UNKNOWN_SNAPSHOT
            ((kind, payload),) = await ask(StateRequest(PREFIX, RequestKind.MANIFEST).encode())
            manifest = StateReply.decode(payload).manifest
            snapshot_id = manifest.snapshot_id
            out_of_range = StateRequest(PREFIX, RequestKind.CHUNKS, snapshot_id, (manifest.num_chunks,))
            ((kind, text),) = await ask(out_of_range.encode())
            assert kind == rpc.ERROR and b"out of range" in text
            frames = await ask(StateRequest(PREFIX, RequestKind.CHUNKS, snapshot_id, (1, 0)).encode())
            digests = [hashlib.sha256(payload).digest() for _, payload in frames[1:]]
            assert digests == [manifest.chunk_hash(1), manifest.chunk_hash(0)]
            # after all that, a newcomer still gets the state
            _, loaded = await load(newcomer)
            assert_same(tensors, loaded)
            await sharing.shutdown()

    run(main())


def test_a_crowd_costs_one_snapshot_and_busy_donors_are_retried():
    async def main():
        async with swarm(5) as (donor, *crowd):
            metadata, tensors = make_state()
            calls = []

            def get_state():
                calls.append(1)
                return metadata, tensors

            sharing = await StateSharing(
                donor.host, donor.node, PREFIX, get_state, chunk_size_bytes=CHUNK, max_concurrent_uploads=1
            ).start()
            results = await asyncio.gather(*(load(p) for p in crowd))
            for _, loaded in results:
                assert_same(tensors, loaded)
            assert sharing.snapshots_taken == 1 and 1 <= len(calls) <= len(crowd)  # one copy; reads are cheap

            # every upload slot taken: the newcomer backs off and succeeds once one frees up
            sharing._uploads = 1
            download = asyncio.ensure_future(load(crowd[0]))
            deadline = time.monotonic() + 10
            while sharing.busy_refusals < 2:  # poll with a deadline
                assert time.monotonic() < deadline and not download.done()
                await asyncio.sleep(0.01)
            sharing._uploads = 0
            _, loaded = await download
            assert_same(tensors, loaded)
            await sharing.shutdown()

    run(main())


def test_declarations_priorities_and_withdrawal():
    async def main():
        async with swarm(3) as (a, b, newcomer):
            state = make_state()
            low = await share(a, state, priority=1, declare_period=5)
            high = await share(b, state, priority=2, declare_period=5)
            donors = await find_donors(newcomer.node, PREFIX)
            assert [d.peer_id for d in donors] == [b.host.peer_id, a.host.peer_id]
            assert donors[0].addrs == tuple(b.host.get_visible_maddrs())
            recent = await find_donors(newcomer.node, PREFIX, min_priority=1.5)
            assert [d.peer_id for d in recent] == [b.host.peer_id]
            await asyncio.to_thread(setattr, low, "priority", 10)  # from a training thread: declared at once
            deadline = time.monotonic() + 10
            while (await find_donors(newcomer.node, PREFIX))[0].peer_id != a.host.peer_id:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            await high.shutdown()  # withdraws: declares None
            assert [d.peer_id for d in await find_donors(newcomer.node, PREFIX)] == [a.host.peer_id]
            await low.shutdown()
            with pytest.raises(ValueError):
                low.priority = float("nan")

    run(main())


def test_two_prefixes_share_one_handler_per_host():
    async def main():
        async with swarm(2) as (donor, newcomer):
            one, two = make_state(0), make_state(1)
            first = await share(donor, one)
            second = await StateSharing(donor.host, donor.node, "other", lambda: two).start()
            with pytest.raises(ValueError, match="already shares"):
                await share(donor, one)
            assert (await load(newcomer, "other"))[0] == two[0]
            await second.shutdown()
            assert (await load(newcomer))[0] == one[0]
            await first.shutdown()
            assert STATE_PROTOCOL not in donor.host.protocols

    run(main())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_donor_with_state_on_the_gpu():
    async def main():
        async with swarm(2) as (donor, newcomer):
            metadata, tensors = make_state()
            on_gpu = [t.cuda() for t in tensors]
            sharing = await share(donor, (metadata, on_gpu))
            _, loaded = await load(newcomer)
            assert_same(tensors, loaded)
            await sharing.shutdown()

    run(main())


# --- without the network ------------------------------------------------------------------------


def test_messages_refuse_inconsistent_fields():
    header = TensorHeader((3, 4), "float32", 0, False, 48)
    with pytest.raises(ValueError, match="has 48 bytes"):
        TensorHeader((3, 4), "float32", 0, False, 47)
    with pytest.raises(ValueError, match="unknown dtype"):
        TensorHeader((3,), "float8", 0, False, 3)
    with pytest.raises(ValueError, match="hashes"):
        StateManifest(b"i" * 16, b"", (header,), 4096, b"")
    with pytest.raises(ValueError, match="chunk_size"):
        StateManifest(b"i" * 16, b"", (header,), 1, b"h" * HASH_SIZE * 48)
    with pytest.raises(ValueError):
        StateRequest(PREFIX, RequestKind.CHUNKS, b"s" * 16, tuple(range(65)))
    with pytest.raises(ValueError):
        StateRequest(PREFIX, RequestKind.MANIFEST, b"s" * 16)
    with pytest.raises(MessageError):
        StateReply.decode(StateReply(9 - 9).encode().replace(b"\x00", b"\x09", 1))
    good = StateManifest(b"i" * 16, b"\x80", (header,) * 200, 4096, b"h" * HASH_SIZE * 3)
    assert StateManifest.decode(good.encode()) == good and good.chunk_length(2) == 9600 - 8192


def test_declarations_parse_defensively():
    peer = Host().peer_id.to_bytes()
    assert parse_declaration(peer, 3).priority == 3.0
    assert parse_declaration(peer, (2, [b"\x00junk", b"x" * 1000])).addrs == ()
    for subkey, value in (
        (b"not a peer id", 1),
        ("str", 1),
        (peer, None),
        (peer, True),
        (peer, float("inf")),
        (peer, "high"),
        (peer, (1, 2, 3)),
    ):
        assert parse_declaration(subkey, value) is None


def test_chunk_board_dedups_claims_and_releases():
    digests = [hashlib.sha256(bytes([i % 3])).digest() for i in range(6)]  # three distinct chunks
    manifest = StateManifest(
        b"i" * 16, b"", (TensorHeader((6 * 4096,), "uint8", 0, False, 6 * 4096),), 4096, b"".join(digests)
    )
    board = _ChunkBoard([manifest], {digests[2]: b"already"})
    assert board.total == 2
    everything = {d: i for i, d in enumerate(digests)}
    first = board.claim(everything, 1)
    assert first == [digests[0]] and board.claim({digests[0]: 0}, 5) == []
    assert board.can_help({digests[0]: 0}) and not board.can_help({digests[2]: 2})
    board.release(first)
    assert board.claim(everything, 5) == [digests[1], digests[0]]
    board.deliver(digests[0], b"a")
    board.deliver(digests[1], b"b")
    assert board.complete


def test_newcomer_takes_the_newest_state_even_when_its_declaration_lags():
    """Right after a step the DHT may still show the old epoch for every donor: what each donor's
    manifest states decides, whatever the random order among equal declarations."""

    async def main():
        async with swarm(3) as (a, b, newcomer):
            old, new = make_state(0), make_state(1)
            behind = await share(a, old, priority=1)
            ahead = await share(b, new, priority=1)

            async def held_back(timeout=None):
                return None

            ahead._declare = held_back  # its re-declaration has not happened yet
            await asyncio.to_thread(setattr, ahead, "priority", 2)
            declared = {d.peer_id: d.priority for d in await find_donors(newcomer.node, PREFIX)}
            assert declared == {a.host.peer_id: 1.0, b.host.peer_id: 1.0}
            firsts = set()
            for seed in range(4):
                firsts.add((await find_donors(newcomer.node, PREFIX, rng=random.Random(seed)))[0].peer_id)
                metadata, loaded = await load(newcomer, rng=random.Random(seed))
                assert metadata == new[0]
                assert_same(new[1], loaded)
            assert a.host.peer_id in firsts, "the stale donor never came first: the case was not exercised"
            # min_priority is judged by the stated priority, not by the lagging declaration
            metadata, _ = await load(newcomer, min_priority=2)
            assert metadata == new[0]
            await behind.shutdown()
            await ahead.shutdown()

    run(main())


@pytest.mark.timeout(30)
def test_every_download_after_a_change_gets_the_current_state():
    """A donor never serves a snapshot of a state that has changed since (in-place writes count),
    keeps at most MAX_SNAPSHOTS, and reuses the newest while the state stands still."""

    async def main():
        async with swarm(2) as (donor, newcomer):
            metadata, tensors = make_state()
            sharing = await share(donor, (metadata, tensors), priority=1)
            for step in range(MAX_SNAPSHOTS + 1):  # each change lands within snapshot_max_age of the last
                tensors[0].add_(1)
                metadata["step"] = step
                loaded_metadata, loaded = await load(newcomer)
                assert loaded_metadata["step"] == step
                assert_same(tensors, loaded)
            assert sharing.snapshots_taken == MAX_SNAPSHOTS + 1 and len(sharing._snapshots) == MAX_SNAPSHOTS
            await load(newcomer)  # nothing changed: the newest snapshot serves again, no copy
            assert sharing.snapshots_taken == MAX_SNAPSHOTS + 1
            sharing.priority = 2
            _, loaded = await load(newcomer, min_priority=2)
            assert_same(tensors, loaded)
            assert sharing.snapshots_taken == MAX_SNAPSHOTS + 2 and len(sharing._snapshots) == MAX_SNAPSHOTS
            await sharing.shutdown()

    run(main())


def test_min_priority_above_every_donor_fails_clearly():
    async def main():
        async with swarm(3) as (a, b, newcomer):
            first = await share(a, make_state(0), priority=1)
            second = await share(b, make_state(1), priority=2)
            with pytest.raises(StateDownloadError, match=r"priority 5(\.0)? or newer.*newest .* is 2(\.0)?"):
                await load(newcomer, min_priority=5, max_attempts=2)
            assert first.chunks_served == second.chunks_served == 0, "no chunk of an old state is fetched"
            await first.shutdown()
            await second.shutdown()

    run(main())


def test_manifest_without_priority_from_an_older_donor_decodes():
    manifest = StateManifest(b"\x01" * 16, b"\x80", (), 1 << 12, b"", priority=3.0)
    assert StateManifest.decode(manifest.encode()).priority == 3.0
    older = msgpack.packb(msgpack.unpackb(manifest.encode())[:-1])
    assert StateManifest.decode(older).priority is None
    with pytest.raises(ValueError):
        StateManifest(b"\x01" * 16, b"\x80", (), 1 << 12, b"", priority=float("inf"))


def test_stated_priority_tells_what_a_donor_would_serve():
    from plexus.averaging.state_download import stated_priority

    async def main():
        async with swarm(3) as (donor, other, reader):
            sharing = await share(donor, make_state(), priority=5)
            assert await stated_priority(reader.host, PREFIX, donor.host.peer_id, timeout=5) == 5
            sharing.priority = 6
            assert await stated_priority(reader.host, PREFIX, donor.host.peer_id, timeout=5) == 6
            assert await stated_priority(reader.host, PREFIX, other.host.peer_id, timeout=5) is None, (
                "a peer that shares no state confirms nothing"
            )
            await sharing.shutdown()

    run(main())
