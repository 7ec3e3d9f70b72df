"""BufferPool hands a buffer out again only once nobody holds it or a memoryview of it, and a
connection never refills an output buffer the transport still holds."""

import pytest

from plexus.p2p.buffer_pool import BufferPool
from plexus.p2p.connection import MAX_OUTPUT_BUFFERS, Connection
from plexus.p2p.identity import PrivateKey

pytestmark = pytest.mark.timeout(10)


def test_a_buffer_comes_back_only_once_its_views_are_gone():
    pool = BufferPool(1024, limit=2)
    view = memoryview(pool.get())[10:20]  # what a stream keeps of a decrypted batch
    second_id = id(pool.get())  # dropped at once: free again
    assert id(pool.get()) == second_id and len(pool) == 2
    held = pool.get()
    assert pool.get() is None  # one viewed, one referenced: at the limit, nothing new
    del held
    assert id(pool.get()) == second_id
    del view
    assert pool.get() is not None and len(pool) == 2


def test_slices_of_a_released_view_still_hold_the_buffer():
    pool = BufferPool(64, limit=1)
    with memoryview(pool.get()) as view:
        piece = view[:8]
    assert pool.get() is None
    del piece
    assert pool.get() is not None


def test_an_output_buffer_the_transport_still_views_is_never_refilled():
    """asyncio 3.12+ keeps views of unsent data (3.11 copies it): a connection must then encrypt
    into another buffer, and hand the transport copies once all pooled buffers are held."""

    class ViewKeepingTransport:
        def __init__(self):
            self.kept = []

        def write(self, data):
            self.kept.append(memoryview(data))

    connection = Connection(PrivateKey.generate(), initiator=True)
    connection._transport = transport = ViewKeepingTransport()
    messages = [i.to_bytes(4, "big") for i in range(MAX_OUTPUT_BUFFERS + 8)]
    for message in messages:
        connection._out[:4] = message
        connection._write_out(4)
    assert [bytes(view) for view in transport.kept] == messages
    assert len(connection._outputs) == MAX_OUTPUT_BUFFERS
