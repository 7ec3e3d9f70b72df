"""A discrete-event simulator that runs Plexus's sans-I/O cores for thousands of peers in virtual time.

`Simulator` (events.py) is the clock; `Internet` (internet.py) the latencies, bandwidths, handshakes
and churn; `SimDHTNode` (dht_node.py) a DHT participant around the real DHT cores; `DHTSwarm`
(swarm.py) a volunteer swarm with a steady workload; `SimMatchmaker` and `MatchmakingSwarm`
(matchmaker.py) peers looking for averaging groups. benchmarks/simulate.py runs them at scale.
"""

from .dht_node import DHTOptions, SimDHTNode
from .events import Simulator
from .internet import Internet, InternetOptions
from .matchmaker import MatchmakingOptions, MatchmakingSwarm, SimMatchmaker
from .swarm import DHTSwarm, SwarmOptions

__all__ = [
    "DHTOptions",
    "DHTSwarm",
    "Internet",
    "InternetOptions",
    "MatchmakingOptions",
    "MatchmakingSwarm",
    "SimDHTNode",
    "SimMatchmaker",
    "Simulator",
    "SwarmOptions",
]
