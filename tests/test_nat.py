"""Peers behind real NATs, built from Linux network namespaces: relay, DHT and averaging end to end.

Topology (every address in 10.200.0.0/16, which exists only inside these namespaces):

    [pub] 10.200.0.1 on bridge br0  <- "the internet": the public peer runs the DHT and the relay
      |                    |
    [r1] wan 10.200.0.11  [r2] wan 10.200.0.12   routers: masquerade out of wan, drop new inbound
    [r1] lan 10.200.1.1   [r2] lan 10.200.2.1    connections, and know no route to the other LAN
      |                    |
    [a] 10.200.1.2        [b] 10.200.2.2         private peers: reach out, cannot be reached

Each peer is a subprocess started with `ip netns exec` running this file's `peer_main`; it reports
JSON lines on stdout, and the test reads them with deadlines. Namespaces, links and processes are
removed whatever happens. Needs root, iproute2 and nftables (`.ci/run` installs them); without them
the test skips, except under CI=true, where it fails.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plexus.testing.netns import NAT_RULES, Namespaces, PeerProcess, emit
from tests.netns_support import require_lab

REPO = Path(__file__).resolve().parents[1]
PEER_TIMEOUT = 60.0


# --- the lab -----------------------------------------------------------------------------------------


class NatLab(Namespaces):
    """The namespaces above; `close()` removes all of them (and what runs inside)."""

    def __init__(self):
        super().__init__("pxnat")

    def build(self) -> "NatLab":
        self.add("pub", "r1", "r2", "a", "b")
        self.ip("pub", "link", "add", "br0", "type", "bridge")
        self.ip("pub", "addr", "add", "10.200.0.1/24", "dev", "br0")
        self.ip("pub", "link", "set", "br0", "up")
        for index, (router, peer) in enumerate((("r1", "a"), ("r2", "b")), start=1):
            self.veth("pub", f"up{index}", router, "wan")
            self.ip("pub", "link", "set", f"up{index}", "master", "br0")
            self.ip("pub", "link", "set", f"up{index}", "up")
            self.ip(router, "addr", "add", f"10.200.0.{10 + index}/24", "dev", "wan")
            self.ip(router, "link", "set", "wan", "up")
            self.veth(router, "lan", peer, "eth0")
            self.ip(router, "addr", "add", f"10.200.{index}.1/24", "dev", "lan")
            self.ip(router, "link", "set", "lan", "up")
            self.ip(peer, "addr", "add", f"10.200.{index}.2/24", "dev", "eth0")
            self.ip(peer, "link", "set", "eth0", "up")
            self.ip(peer, "route", "add", "default", "via", f"10.200.{index}.1")
            self.sysctl(router, "net.ipv4.ip_forward=1")
            self.nft(router, NAT_RULES)
        return self

    def start_peer(self, ns: str, *args: str) -> PeerProcess:
        process = self.spawn(
            ns,
            [sys.executable, "-m", "tests.test_nat", *args],
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            cwd=str(REPO),
        )
        return PeerProcess(ns, process)


# --- the test ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("punch", ["punch", "relay-only"])
def test_private_peers_behind_nat_use_the_relay_for_dht_and_averaging(punch):
    """With hole punching the private peers end up on a direct connection; without, everything,
    averaging included, runs through the relay."""
    require_lab()
    lab = NatLab()
    try:
        lab.build()
        # The routers really are NATs: the public side cannot open a connection to a private peer.
        assert "unreachable" in lab.run(sys.executable, "-c", PROBE % ("10.200.1.2", 9), ns="pub")
        public = lab.start_peer("pub", "public", "10.200.0.1")
        relay = public.wait_for("ready")["maddrs"][0]
        a = lab.start_peer("a", "private", "10.200.1.2", relay, "a", "b", punch)
        b = lab.start_peer("b", "private", "10.200.2.2", relay, "b", "a", punch)
        for peer in (a, b):
            ready = peer.wait_for("ready")
            assert all("/p2p-circuit" in addr for addr in ready["advertised"]), ready
        if punch == "relay-only":  # `plexus doctor` from behind a NAT, while the peers start up
            doctor = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    lab.full("a"),
                    sys.executable,
                    "-m",
                    "plexus.cli.main",
                    "doctor",
                    "--peer",
                    relay,
                    "--host_maddrs",
                    "/ip4/10.200.1.2/tcp/0",
                    "--json",
                    "--timeout",
                    "10",
                ],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=60,
            )
            diagnosis = json.loads(doctor.stdout)
            assert doctor.returncode == 1 and diagnosis["nat"].startswith("behind NAT"), diagnosis
            assert diagnosis["reachability"] == "private", diagnosis
            assert diagnosis["relays"] and "error" not in diagnosis["relays"][0], diagnosis  # it offers one
            assert any("Forward the listening port" in advice for advice in diagnosis["advice"]), diagnosis
            print("doctor:", {key: diagnosis[key] for key in ("nat", "reachability", "clock_skew")})
        results = {peer.name: peer.wait_for("done") for peer in (a, b)}
        public_dht = public.wait_for("dht")
        public.finish()
        relay_stats = public.wait_for("bye")

        assert public_dht["values"] == {"a": "from a", "b": "from b", "pub": "from pub"}
        for name, _other in (("a", "b"), ("b", "a")):
            result = results[name]
            assert result["dht"] == {"a": "from a", "b": "from b", "pub": "from pub"}, result
            # AutoNAT: the public peer could not dial back through the NAT, so: private, use relays.
            assert (result["reachability"], result["mode"]) == ("private", "relay"), result
            # Their first connection went through the relay (the DHT may have made it before our ping);
            # when hole punching worked, the ping used the punched direct connection instead.
            assert result["ping_connection"] == (
                "direct" if result["hole_punch"].startswith("direct") else "relayed"
            ), result
            if punch == "relay-only":
                assert result["hole_punch"] == "not enabled" and result["first_connection"] == "relayed"
            assert result["averaged"] == pytest.approx(1.5), result  # mean of 1.0 (a) and 2.0 (b)
            assert result["group"] == sorted([results["a"]["peer_id"], results["b"]["peer_id"]]), result
        assert relay_stats["circuits_served"] >= 1, relay_stats
        if punch == "relay-only":  # the averaged tensors (2 x 4000 bytes each way) crossed the relay
            assert relay_stats["bytes_relayed"] > 4 * 4000, relay_stats
        print("relay:", relay_stats)
        print("hole punching:", {name: results[name]["hole_punch"] for name in results})
        print("ping rtt (s):", {name: round(results[name]["rtt"], 4) for name in results})
        if os.environ.get("PLEXUS_NAT_LOGS"):
            for peer in (public, a, b):
                print(peer.name, peer.log)
    finally:
        lab.close()


PROBE = """
import socket, sys
s = socket.socket(); s.settimeout(3)
try:
    s.connect((%r, %d)); print("connected")
except OSError as error:
    print("unreachable", error)
"""


# --- what runs inside each namespace ------------------------------------------------------------------


def peer_main(argv: list[str]) -> None:
    """A peer made only through the public API: the DHT's options attach relays, AutoNAT and DCUtR."""
    import torch

    from plexus.averaging.averager import DecentralizedAverager
    from plexus.dht.dht import DHT
    from plexus.utils.logging import use_plexus_log_handler
    from plexus.utils.timing import get_dht_time

    use_plexus_log_handler("WARNING", stream=sys.stderr)
    role, ip = argv[0], argv[1]
    listen = [f"/ip4/{ip}/tcp/0"]
    names = ["a", "b", "pub"]
    if role == "public":  # nobody could check that it is public (it is the first peer), so it says so
        dht = DHT(host_maddrs=listen, start=True, force_reachability="public")
        assert dht.relay_service is not None and dht.nat_mode == "direct"
        emit("ready", maddrs=[str(addr) for addr in dht.get_visible_maddrs()])
        me = "pub"
    else:
        relay, me, other, punch = argv[2], argv[3], argv[4], argv[5] == "punch"
        dht = DHT(
            initial_peers=[relay], host_maddrs=listen, use_auto_relay=True, hole_punching=punch, start=True
        )
        emit(
            "ready",
            advertised=[str(addr) for addr in dht.get_visible_maddrs() if str(addr).startswith(relay)],
        )
    dht.store(f"nat_{me}", {"text": f"from {me}", "peer_id": str(dht.peer_id)}, get_dht_time() + 300)
    values = _wait_for_values(dht, names, get_dht_time)
    emit("dht", values={name: value["text"] for name, value in values.items()})
    if role == "public":
        sys.stdin.read()  # stay up until the test is done with the private peers
        service = dht.relay_service
        emit("bye", circuits_served=service.circuits_served, bytes_relayed=service.bytes_relayed)
        dht.shutdown()
        return
    other_id = values[other]["peer_id"]
    rtt, first, now = dht.run_coroutine(lambda dht, node: _ping(dht, other_id, dial=me == "a"))
    rank = 1.0 if me == "a" else 2.0
    averager = DecentralizedAverager(
        [torch.full((1000,), rank)],
        dht,
        prefix="nat",
        target_group_size=2,
        min_matchmaking_time=2.0,
        request_timeout=2.0,
        start=True,
    )
    result = averager.step(gather=str(dht.peer_id), timeout=60)
    with averager.get_tensors() as tensors:
        averaged = float(tensors[0].mean())
    hole_punch = dht.run_coroutine(lambda dht, node: _hole_punch(dht, other_id))
    emit(
        "done",
        peer_id=str(dht.peer_id),
        dht={name: value["text"] for name, value in values.items()},
        first_connection=first,
        ping_connection=now,
        rtt=rtt,
        reachability=dht.reachability,
        mode=dht.nat_mode,
        averaged=averaged,
        group=sorted(result.values()),
        hole_punch=hole_punch,
    )
    averager.shutdown()
    dht.shutdown()


async def _ping(dht, peer_id_text, dial: bool):
    """One side dials (through the relay), the other waits for that connection, so there is one."""
    import asyncio

    from plexus.p2p.identity import PeerID

    host, peer = dht.host, PeerID.from_string(peer_id_text)
    if not dial:
        async with asyncio.timeout(20):
            while host.get_connection(peer) is None:
                await asyncio.sleep(0.05)  # poll with a deadline
    first = await host.connect(peer, timeout=20)
    first_kind = "relayed" if getattr(first, "relayed", False) else "direct"
    if getattr(first, "relayed", False) and dht.hole_puncher:  # the inbound side punches; let it finish
        await dht.hole_puncher.wait_outcome(peer, timeout=30)
    rtt = await host.ping(peer, timeout=20)
    now_kind = "relayed" if getattr(host.get_connection(peer), "relayed", False) else "direct"
    return rtt, first_kind, now_kind


async def _hole_punch(dht, peer_id_text):
    from plexus.p2p.dcutr import try_direct_upgrade
    from plexus.p2p.identity import PeerID

    return await try_direct_upgrade(dht.hole_puncher, PeerID.from_string(peer_id_text))


def _wait_for_values(dht, names, clock, timeout: float = 40.0) -> dict:
    deadline = time.monotonic() + timeout
    values = {}
    while len(values) < len(names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"only found DHT values {sorted(values)} of {names}")
        for name in names:
            if name not in values and (found := dht.get(f"nat_{name}", latest=True)) is not None:
                values[name] = found.value
        if len(values) < len(names):
            time.sleep(0.2)  # poll the DHT; the deadline above bounds the wait
    return values


if __name__ == "__main__":
    peer_main(sys.argv[1:])
