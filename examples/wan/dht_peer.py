"""One peer of examples/wan/mixed_swarm.toml: a Plexus DHT over the lab's emulated links.

The WAN lab runs it in every peer's namespace with PLEXUS_LAB_PEER (this peer's name),
PLEXUS_LAB_ADDRESS (where to listen), PLEXUS_LAB_PEERS (every peer's address) and PLEXUS_LAB_DIR
(a directory all peers share). The peer named "server" starts the swarm and leaves its multiaddr
there; the others join through it. Every peer stores a record, then reads everyone's and prints
how long each read took.
"""

import json
import os
import time
from pathlib import Path

from plexus import DHT
from plexus.testing import wait_until
from plexus.utils.timing import get_dht_time

me, address = os.environ["PLEXUS_LAB_PEER"], os.environ["PLEXUS_LAB_ADDRESS"]
peers = json.loads(os.environ["PLEXUS_LAB_PEERS"])
first_address = Path(os.environ["PLEXUS_LAB_DIR"]) / "server.maddr"

if me == "server":
    dht = DHT(host_maddrs=[f"/ip4/{address}/tcp/0"], start=True)
    first_address.write_text(str(dht.get_visible_maddrs()[0]))
else:
    wait_until(first_address.exists, timeout=60, interval=0.1, message="the server's address is there")
    dht = DHT(initial_peers=[first_address.read_text()], host_maddrs=[f"/ip4/{address}/tcp/0"], start=True)

dht.store(f"record-{me}", f"hello from {me}", get_dht_time() + 300)
for name in peers:
    started = time.monotonic()
    wait_until(
        lambda: dht.get(f"record-{name}", latest=True) is not None,
        timeout=60,
        interval=0.2,
        message=f"the record of {name} is found",
    )
    print(f"{me}: found {name}'s record in {time.monotonic() - started:.2f} s")
dht.shutdown()
