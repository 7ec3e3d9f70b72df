"""BufferPool hands a buffer out again only once nobody holds it or a memoryview of it."""

import pytest

from plexus.p2p.buffer_pool import BufferPool

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
