"""RPC over real hosts: unary and streaming calls, typed messages, errors, timeouts, limits."""

import asyncio
import os
from dataclasses import dataclass

import pytest

from plexus.p2p import rpc
from plexus.p2p.host import Host
from plexus.p2p.messages import Message
from plexus.p2p.protocols.varint import encode_uvarint

pytestmark = pytest.mark.timeout(30)


@dataclass(frozen=True)
class Add(Message):
    a: int
    b: int


@dataclass(frozen=True)
class Sum(Message):
    total: int


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 25))


async def pair():
    a = await Host(host_maddrs=()).start()
    b = await Host(host_maddrs=("/ip4/127.0.0.1/tcp/0",)).start()
    a.add_addrs(b.peer_id, b.get_listen_maddrs())
    return a, b


def test_unary_typed_call_and_handler_error():
    async def main():
        a, b = await pair()

        async def add(request: Add, context) -> Sum:
            assert context.remote_peer == a.peer_id
            if request.a < 0:
                raise ValueError("negative numbers are not welcome here")
            return Sum(request.a + request.b)

        rpc.add_handler(b, "/test/add/1.0.0", add, Add, Sum)
        assert await rpc.call(a, b.peer_id, "/test/add/1.0.0", Add(2, 3), Sum, timeout=5) == Sum(5)
        with pytest.raises(rpc.RPCError, match="negative numbers are not welcome here"):
            await rpc.call(a, b.peer_id, "/test/add/1.0.0", Add(-1, 3), Sum, timeout=5)
        # garbage instead of an Add: a clear error comes back, and the service keeps serving
        with pytest.raises(rpc.RPCError, match="malformed Add"):
            await rpc.call(a, b.peer_id, "/test/add/1.0.0", b"\x93\x01\x02\x03", Sum, timeout=5)
        assert await rpc.call(a, b.peer_id, "/test/add/1.0.0", Add(1, 1), Sum, timeout=5) == Sum(2)
        await a.shutdown()
        await b.shutdown()

    run(main())


def test_server_client_and_bidirectional_streaming():
    async def main():
        a, b = await pair()

        async def count(request: bytes, context):
            for i in range(int(request)):
                yield str(i).encode()

        async def total(requests, context):
            return str(sum([int(r) async for r in requests])).encode()

        async def doubler(requests, context):
            async for request in requests:
                yield request * 2

        rpc.add_handler(b, "/test/count/1.0.0", count, stream_output=True)
        rpc.add_handler(b, "/test/total/1.0.0", total, stream_input=True)
        rpc.add_handler(b, "/test/double/1.0.0", doubler, stream_input=True, stream_output=True)
        got = [r async for r in rpc.call_stream(a, b.peer_id, "/test/count/1.0.0", b"5", timeout=5)]
        assert got == [b"0", b"1", b"2", b"3", b"4"]

        async def numbers():
            for i in range(100):
                yield str(i).encode()

        got = [r async for r in rpc.call_stream(a, b.peer_id, "/test/total/1.0.0", numbers(), timeout=5)]
        assert got == [b"4950"]

        async def big_parts():  # more than a window's worth in flight in both directions
            for i in range(8):
                yield bytes([i]) * (1 << 20)

        got = [
            r
            async for r in rpc.call_stream(
                a, b.peer_id, "/test/double/1.0.0", big_parts(), timeout=10, max_message_size=4 << 20
            )
        ]
        assert [len(r) for r in got] == [2 << 20] * 8 and [r[0] for r in got] == list(range(8))
        await a.shutdown()
        await b.shutdown()

    run(main())


def test_chunks_deliver_each_message_as_uncopied_pieces():
    """A Chunks reader gets each message as buffers that join to exactly the bytes sent: small
    frames, frames larger than the stream's receive window, and an error frame as RPCError."""

    async def main():
        a, b = await pair()
        payloads = [b"x", os.urandom(300 << 10), os.urandom(3 << 20), b""]

        async def send_all(request: bytes, context):
            for payload in payloads:
                yield payload
            raise ValueError("that was all")

        rpc.add_handler(b, "/test/chunks/1.0.0", send_all, stream_output=True, max_message_size=4 << 20)
        got = []
        with pytest.raises(rpc.RPCError, match="that was all"):
            async for chunks in rpc.call_stream(
                a, b.peer_id, "/test/chunks/1.0.0", b"go", rpc.Chunks, timeout=10, max_message_size=4 << 20
            ):
                assert isinstance(chunks, list)
                got.append(b"".join(chunks))
        assert got == payloads
        await a.shutdown()
        await b.shutdown()

    run(main())


def test_readexactly_chunks_reports_an_early_end():
    async def main():
        a, b = await pair()

        async def short(stream):
            await stream.write(b"only nine")
            await stream.close()

        b.set_stream_handler("/test/short/1.0.0", short)
        stream = await a.new_stream(b.peer_id, "/test/short/1.0.0")
        with pytest.raises(asyncio.IncompleteReadError) as raised:
            await stream.readexactly_chunks(100)
        assert raised.value.partial == b"only nine" and raised.value.expected == 100
        await a.shutdown()
        await b.shutdown()

    run(main())


def test_timeout_bounds_the_call_and_limits_hold():
    async def main():
        a, b = await pair()
        never = asyncio.Event()

        async def stuck(request, context):
            await never.wait()

        async def echo(request, context):
            return request

        rpc.add_handler(b, "/test/stuck/1.0.0", stuck)
        rpc.add_handler(b, "/test/echo/1.0.0", echo, max_message_size=1024)
        with pytest.raises(TimeoutError):
            await rpc.call(a, b.peer_id, "/test/stuck/1.0.0", b"x", timeout=0.2)
        with pytest.raises(rpc.RPCError, match="exceeds the 1024-byte limit"):
            await rpc.call(a, b.peer_id, "/test/echo/1.0.0", b"x" * 2000, timeout=5)
        with pytest.raises(rpc.RPCError, match="exceeds the 1024-byte limit"):  # larger than the window
            await rpc.call(a, b.peer_id, "/test/echo/1.0.0", b"x" * (5 << 20), timeout=5)
        with pytest.raises(rpc.RPCProtocolError, match="exceeds"):
            rpc.add_handler(b, "/test/big/1.0.0", lambda r, c: _big())
            await rpc.call(a, b.peer_id, "/test/big/1.0.0", b"", timeout=5, max_message_size=1000)
        assert await rpc.call(a, b.peer_id, "/test/echo/1.0.0", b"still fine", timeout=5) == b"still fine"
        await a.shutdown()
        await b.shutdown()

    run(main())


async def _big():
    return b"y" * 5000


def test_message_decoding_validates_every_field():
    assert Add.decode(Add(1, 2).encode()) == Add(1, 2)
    for bad in (b"", b"\xc1", Sum(1).encode(), b"\x92\xa1x\x01"):
        with pytest.raises(ValueError):
            Add.decode(bad)


def test_unary_call_costs_one_socket_write_each_way():
    """Stream open, multistream proposal, request and FIN leave together, and so do the answer,
    the response and its FIN: frames are coalesced per loop iteration, not flushed one by one."""

    async def main():
        a, b = await pair()

        async def echo(request: bytes, context) -> bytes:
            return request

        rpc.add_handler(b, "/test/echo/1.0.0", echo)
        assert await rpc.call(a, b.peer_id, "/test/echo/1.0.0", b"warm-up", timeout=5) == b"warm-up"
        connections = [a.get_connection(b.peer_id), b.get_connection(a.peer_id)]
        writes = []
        for connection in connections:
            transport = connection._transport
            original = transport.write

            def counting_write(data, original=original):
                writes.append(len(data))
                return original(data)

            transport.write = counting_write
        calls = 50
        for i in range(calls):
            request = f"request {i}".encode() * 10
            assert await rpc.call(a, b.peer_id, "/test/echo/1.0.0", request, timeout=5) == request
        assert len(writes) <= 2 * calls, f"{len(writes) / calls:.1f} socket writes per unary call"
        await a.shutdown()
        await b.shutdown()

    run(main())


def test_frames_cut_anywhere_and_packed_together_read_the_same():
    """read_frame parses a header in place when it is buffered and falls back to reading byte by
    byte when not: frames split mid-header, packed several to a write, empty, larger than a
    small frame, and an error frame all come out as sent, and a bad kind is still refused."""

    async def main():
        a, b = await pair()
        payloads = [b"first", b"", b"x" * 300, b"y" * (70 << 10), b"z"]
        wire = b"".join(bytes([rpc.MESSAGE]) + encode_uvarint(len(p)) + p for p in payloads)
        wire += bytes([rpc.ERROR]) + encode_uvarint(4) + b"oops"

        async def raw(stream):
            await rpc.read_frame(stream, 1024)
            cuts = [0, 1, 3, 9, 310, len(wire) - 3, len(wire)]  # inside headers, across frames
            for start, end in zip(cuts, cuts[1:]):
                await stream.write(wire[start:end])
                await asyncio.sleep(0)  # give each piece its own flush where possible
            await stream.close()

        b.set_stream_handler("/test/raw/1.0.0", raw)
        got = []
        with pytest.raises(rpc.RPCError, match="oops"):
            async for message in rpc.call_stream(a, b.peer_id, "/test/raw/1.0.0", b"go", timeout=5):
                got.append(message)
        assert got == payloads

        async def bad_kind(stream):
            await rpc.read_frame(stream, 1024)
            await stream.write(b"\x07\x01a")
            await stream.close()

        b.set_stream_handler("/test/bad/1.0.0", bad_kind)
        with pytest.raises(rpc.RPCProtocolError, match="unknown RPC frame kind 7"):
            await rpc.call(a, b.peer_id, "/test/bad/1.0.0", b"go", timeout=5)
        await a.shutdown()
        await b.shutdown()

    run(main())
