"""What the donors' vote costs a newcomer's state download (plexus/averaging/state_vote.py).

Run: `.venv/bin/python benchmarks/state_vote.py [--mib 64] [--rounds 5]`

Four peers in one event loop on 127.0.0.1: three donors and a newcomer, `--mib` MiB of float32
state. Three prefixes are shared at once, so every round measures each case under the same load:
  * one: a single donor shares (the baseline: nothing to vote on),
  * agree: all three donors share the same state (the vote settles on the manifests),
  * disagree: each donor shares a slightly different state (each is downloaded and compared).
A round downloads each prefix once (fresh chunks each time); the table shows the median seconds
and the ratio to `one` in the same run.
"""

import argparse
import asyncio
import contextlib
import statistics
import time

import torch

from plexus.averaging.state_download import load_state_from_peers
from plexus.averaging.state_sharing import StateSharing
from plexus.dht.node import DHTNode
from plexus.dht.p2p_transport import HostDHTTransport
from plexus.p2p.host import Host


async def make_peer(bootstrap=None):
    host = await Host(host_maddrs=("/ip4/127.0.0.1/tcp/0",)).start()
    initial = []
    if bootstrap is not None:
        await host.connect(bootstrap[0].get_visible_maddrs()[0])
        initial = [bootstrap[0].peer_id]
    node = await DHTNode.create(initial_peers=initial, rpc=HostDHTTransport(host), wait_timeout=1.0)
    return host, node


async def main(mib: int, rounds: int) -> None:
    peers = [await make_peer()]
    for _ in range(3):
        peers.append(await make_peer(peers[0]))
    *donors, newcomer = peers
    base = torch.randn(mib << 18)
    states = {
        "one": [base],
        "agree": [base, base, base],
        "disagree": [base, base + 1e-3, base - 1e-3],
    }
    sharers = []
    async with contextlib.AsyncExitStack() as stack:
        for prefix, tensors in states.items():
            for (host, node), tensor in zip(donors, tensors):
                state = ({"prefix": prefix}, [tensor])
                sharer = await StateSharing(host, node, prefix, lambda state=state: state).start()
                sharers.append(sharer)
                stack.push_async_callback(sharer.shutdown)
        times = {prefix: [] for prefix in states}
        for _ in range(rounds):
            for prefix in states:
                for sharer in sharers:
                    sharer.state_changed()  # a fresh snapshot and fresh chunks every round
                started = time.perf_counter()
                await load_state_from_peers(*newcomer, prefix, timeout=300)
                times[prefix].append(time.perf_counter() - started)
        baseline = statistics.median(times["one"])
        print(f"{mib} MiB of state, median of {rounds} rounds")
        print(f"{'case':<10} {'s':>8} {'x one':>7}")
        for prefix, seconds in times.items():
            median = statistics.median(seconds)
            print(f"{prefix:<10} {median:>8.3f} {median / baseline:>7.2f}")
    for host, node in peers:
        await node.shutdown()
        await host.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.mib, args.rounds))
