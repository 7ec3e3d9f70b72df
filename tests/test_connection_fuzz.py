"""Hostile peers against a live Host: garbage at every stage of the upgrade and after it.

The invariant: whatever a peer sends, the host closes that one connection (or keeps it, if the
bytes were valid), never hangs, never lets an exception escape into the event loop, and keeps
serving everyone else.
"""

import asyncio
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plexus.p2p.host import Host
from plexus.p2p.identity import PrivateKey
from plexus.p2p.protocols.multistream import encode_message
from plexus.p2p.protocols.noise import NoiseHandshake
from plexus.p2p.protocols.yamux import encode_header

pytestmark = pytest.mark.timeout(120)

HEADER = encode_message("/multistream/1.0.0")


async def raw_noise_session(port: int, server_peer):
    """Dial like a real peer up to an encrypted channel; return (reader, writer, transport)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(HEADER + encode_message("/noise"))
    expected = HEADER + encode_message("/noise")
    assert await reader.readexactly(len(expected)) == expected
    handshake = NoiseHandshake(PrivateKey.generate(), initiator=True, expected_peer=server_peer)
    writer.write(handshake.data_to_send())
    while not handshake.complete:
        handshake.receive_data(await reader.read(65536))
    writer.write(handshake.data_to_send())
    return reader, writer, handshake.to_transport()


def seal(transport, plaintext: bytes) -> bytes:
    out = bytearray(len(plaintext) + 18 * (len(plaintext) // transport.MAX_PLAINTEXT + 1))
    end, view = 0, memoryview(plaintext)
    while True:
        end = transport.seal_into(view[: transport.MAX_PLAINTEXT], out, end)
        view = view[transport.MAX_PLAINTEXT :]
        if not view:
            return bytes(out[:end])


async def drain_until_closed(reader) -> None:
    try:
        while await reader.read(65536):
            pass
    except ConnectionResetError:  # the host aborted the connection: also a clean outcome
        pass


def check_host_survives(stage: str, payloads: list[bytes]) -> None:
    errors = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        server = await Host(host_maddrs=("/ip4/127.0.0.1/tcp/0",), dial_timeout=2).start()
        friend = await Host(host_maddrs=()).start()
        port = int(server.get_listen_maddrs()[0].value_for_protocol("tcp"))
        for payload in payloads:
            if stage == "plaintext":
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(payload)
            else:
                reader, writer, transport = await raw_noise_session(port, server.peer_id)
                if stage == "encrypted-garbage":
                    writer.write(payload)
                else:  # valid Noise frames around garbage yamux/multistream bytes
                    writer.write(seal(transport, HEADER + encode_message("/yamux/1.0.0") + payload))
            if not writer.is_closing():
                writer.write_eof()
            await asyncio.wait_for(drain_until_closed(reader), 10)
            writer.close()
        assert await friend.ping(server.get_visible_maddrs()[0]) < 5
        await friend.shutdown()
        await server.shutdown()

    asyncio.run(main())
    assert not errors, errors


fuzz = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@fuzz
@given(st.lists(st.binary(max_size=3000), min_size=1, max_size=3))
def test_garbage_before_the_handshake(payloads):
    check_host_survives("plaintext", [HEADER + encode_message("/noise") + p for p in payloads] + payloads)


@fuzz
@given(st.lists(st.binary(max_size=3000), min_size=1, max_size=3))
def test_garbage_instead_of_noise_transport_frames(payloads):
    check_host_survives("encrypted-garbage", payloads)


frames = st.builds(
    lambda kind, flags, stream_id, length, body: encode_header(kind, flags, stream_id, length) + body,
    st.integers(0, 5),
    st.integers(0, 15),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.binary(max_size=64),
)


@fuzz
@given(st.lists(st.one_of(frames, st.binary(max_size=200)), min_size=1, max_size=8))
def test_garbage_yamux_frames_inside_valid_encryption(parts):
    check_host_survives("encrypted-yamux", [b"".join(parts)])


def test_oversized_and_flooding_peers():
    check_host_survives("plaintext", [b"\xff" * 70000, os.urandom(1 << 20)])
    check_host_survives("encrypted-yamux", [encode_header(0, 1, 1, 1 << 30) + os.urandom(100000)])
