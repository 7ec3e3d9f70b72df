"""The compatibility suite imports Plexus only through hivemind's module paths, as hivemind code does:
the opt-in hook is installed before any test module here is imported."""

import pytest

import plexus.compat

plexus.compat.install()

LOCAL = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture
def dht_pair():
    """Two DHT peers on 127.0.0.1, the second joined through the first."""
    from hivemind import DHT

    first = DHT(start=True, host_maddrs=LOCAL)
    second = DHT(start=True, initial_peers=first.get_visible_maddrs(), host_maddrs=LOCAL)
    yield first, second
    second.shutdown()
    first.shutdown()
