"""Plexus: train one neural network together over the internet, with no master node.

The public names mirror hivemind's, so `import plexus as hivemind` runs hivemind scripts.
"""

from .dht.dht import DHT
from .p2p.identity import PeerID
from .utils.timing import get_dht_time

from .version import __version__

__all__ = ["DHT", "PeerID", "get_dht_time", "__version__"]
