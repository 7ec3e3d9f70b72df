"""Check this machine's connectivity: addresses, NAT, reachability, relays and clock skew.

Joins the swarm through one of its peers (any running `plexus dht` peer) as a `plexus.DHT` with the
listening addresses given, so the checks use the DHT's own host, relay client and AutoNAT, then reports:
- the addresses this peer would advertise, and the address the other peer sees it at;
- whether a NAT sits in between (the observed IP is not one of ours);
- reachability, by asking the peer to dial us back (AutoNAT, when it serves it);
- relays in use (reserved with --relays, or on the peer itself when we are private and it relays);
- the clock difference with the peer (DHT ping), since records expire on absolute times;
and ends with what to change when something is wrong. Exit status 0 when nothing is wrong.

Example:
    plexus doctor --peer /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...
    plexus doctor --peer /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW... --host_maddrs /ip4/0.0.0.0/tcp/31338 --json
"""

import asyncio
import json
import time

from ..dht.dht import DHT
from ..dht.messages import PingRequest, PingResponse, decode_response
from ..dht.p2p_transport import DHT_PROTOCOL
from ..p2p import rpc
from ..p2p.host import Host, local_ips
from ..p2p.multiaddr import Multiaddr, MultiaddrError, parse_host_port
from ..p2p.protocols import autonat as autonat_core
from ..p2p.protocols import relay as relay_core
from ..p2p.relay import RelayClient
from . import checks
from .config import add_config_argument

SKEW_WARNING = 3.0  # seconds; the DHT warns at the same bound


def add_arguments(parser) -> None:
    parser.add_argument(
        "--peer",
        required=True,
        type=checks.peer_multiaddr,
        metavar="MADDR",
        help="a running peer to test against (…/p2p/<peer id>), e.g. one of --initial_peers",
    )
    parser.add_argument(
        "--host_maddrs",
        nargs="*",
        type=checks.multiaddr,
        default=["/ip4/0.0.0.0/tcp/0"],
        metavar="MADDR",
        help="addresses to listen on while testing (use your training peer's port to test it)",
    )
    parser.add_argument(
        "--relays",
        nargs="*",
        type=checks.multiaddr,
        default=[],
        metavar="MADDR",
        help="relays to try reserving on",
    )
    parser.add_argument(
        "--timeout", type=checks.positive_float, default=15.0, help="seconds for each check (default 15)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    add_config_argument(parser)


def run(args) -> int:
    report = diagnose(args.peer, args.host_maddrs, args.relays, args.timeout)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0 if not report["problems"] else 1


def diagnose(peer: str, host_maddrs, relays=(), timeout: float = 15.0) -> dict:
    """Join the swarm through `peer` as a DHT peer would (same host, relay client and AutoNAT), run
    every check; returns a JSON-ready dict with `problems` and `advice` lists."""
    report: dict = {"peer": peer, "problems": [], "advice": []}
    dht = None
    try:
        target = Multiaddr(peer)
        dht = DHT(
            initial_peers=[target],
            host_maddrs=host_maddrs,
            client_mode=not host_maddrs,
            auto_nat=False,
            relay_service=False,
            use_auto_relay=False,
            bootstrap_timeout=timeout,
            startup_timeout=3 * timeout + 5,
        )
        dht.run_in_background(await_ready=True)
    except (OSError, TimeoutError, ConnectionError, ValueError) as error:  # MultiaddrError is a ValueError
        report["problems"].append(f"could not connect to {peer}: {error}")
        report["advice"].append(
            "Check the address (it must end in /p2p/<peer id>), that the peer is running, "
            "and that its port is open in its firewall."
        )
        return report
    finally:
        if dht is not None and not dht.is_alive():
            dht.shutdown()
    try:
        return dht.run_coroutine(lambda dht, node: _diagnose(report, dht, target, relays, timeout))
    finally:
        dht.shutdown()


async def _diagnose(report: dict, dht: DHT, target: Multiaddr, relays, timeout: float) -> dict:
    host = dht.host
    report["listen_addrs"] = [str(addr) for addr in host.get_listen_maddrs()]
    info = await host.identify(target.peer_id, timeout=timeout)
    report["peer_agent"] = info.agent_version
    _check_nat(report, info.observed_addr, host)
    await _check_clock(report, host, target.peer_id, timeout)
    await _check_reachability(report, dht, target.peer_id, info.protocols, timeout)
    await _check_relays(report, dht.relay_client, target, info.protocols, relays, timeout)
    report["visible_addrs"] = [str(addr) for addr in host.get_visible_maddrs(include_observed=True)]
    return report


def _check_nat(report: dict, observed: Multiaddr | None, host: Host) -> None:
    report["observed_addr"] = str(observed) if observed else None
    if observed is None:
        report["nat"] = "unknown (the peer did not say where it sees us)"
        return
    try:
        ip, _port, family = parse_host_port(observed)
    except MultiaddrError:
        report["nat"] = f"unknown (observed address {observed} is not TCP)"
        return
    ours = set(local_ips(family)) | {parse_host_port(a)[0] for a in host.get_listen_maddrs()}
    report["nat"] = (
        "none: the peer sees one of our own addresses"
        if ip in ours
        else f"behind NAT: the peer sees us at {ip}, which is not an address of this machine"
    )


async def _check_clock(report: dict, host: Host, peer, timeout: float) -> None:
    try:
        sent = time.time()
        data = await rpc.call(host, peer, DHT_PROTOCOL, PingRequest(None).encode(), timeout=timeout)
        received = time.time()
        theirs = decode_response(data, PingResponse).dht_time
    except Exception as error:  # any failure here is a finding, not a crash of the doctor
        report["clock_skew"] = None
        report["problems"].append(f"could not ping the peer's DHT to compare clocks: {error!r}")
        return
    skew = theirs - (sent + received) / 2
    report["clock_skew"] = round(skew, 3)
    if abs(skew) > SKEW_WARNING:
        report["problems"].append(f"our clock differs from the peer's by {skew:+.1f} s")
        report["advice"].append(
            "Synchronise the clock with NTP (e.g. `timedatectl set-ntp true`): DHT records "
            "expire on absolute times and matchmaking depends on them."
        )


async def _check_reachability(report: dict, dht: DHT, peer, protocols, timeout: float) -> None:
    if not dht.host.get_listen_maddrs():
        report["reachability"] = "client (not listening)"
        return
    if autonat_core.PROTOCOL not in protocols:
        report["reachability"] = "unknown (the peer does not run AutoNAT)"
        return
    try:
        await dht.check_reachability([peer], timeout=timeout)
    except Exception as error:  # reported, never raised: this is a diagnosis
        report["reachability"] = f"unknown ({error!r})"
        return
    autonat, answer = dht.autonat, dht.autonat.answers.get(peer)
    if answer is None:
        report["reachability"] = "unknown (the peer did not answer our dial-back request)"
        return
    report["reachability"] = autonat.reachability.value
    report["autonat_answer"] = f"{answer.status.name} {answer.text}".strip()
    if autonat.reachability is autonat_core.Reachability.PRIVATE:
        report["problems"].append("other peers cannot connect to this machine")
        report["advice"].append(
            "Forward the listening port on your router and pass --announce_maddrs with your "
            "public address, or use relays (--relays, or any public peer that relays), or "
            "run with --client_mode."
        )


async def _check_relays(
    report: dict, client: RelayClient | None, target: Multiaddr, protocols, relays, timeout
) -> None:
    candidates = [Multiaddr(relay) for relay in relays]
    if not candidates and relay_core.HOP_PROTOCOL in protocols and report.get("reachability") != "public":
        candidates = [target]
    report["relays"] = []
    if client is None:
        return
    for relay in candidates:
        try:
            reservation = await asyncio.wait_for(client.reserve(relay, keep=False), timeout)
            report["relays"].append(
                {
                    "relay": str(relay),
                    "expires_in": round(reservation.expire - time.time()),
                    "limit": vars(reservation.limit) if reservation.limit else None,
                }
            )
        except Exception as error:  # reported, never raised
            report["relays"].append({"relay": str(relay), "error": str(error)})
            report["problems"].append(f"could not reserve a slot on relay {relay}: {error}")
    report["circuit_addrs"] = [str(addr.with_peer_id(client.host.peer_id)) for addr in client.relay_addrs()]


def format_report(report: dict) -> str:
    lines = [f"plexus doctor: checked against {report['peer']}"]
    for key, title in (
        ("listen_addrs", "listening on"),
        ("visible_addrs", "visible addresses"),
        ("observed_addr", "the peer sees us at"),
        ("nat", "NAT"),
        ("reachability", "reachability"),
        ("autonat_answer", "dial-back answer"),
        ("clock_skew", "clock skew (s)"),
        ("relays", "relays"),
        ("circuit_addrs", "relay addresses"),
    ):
        if key in report:
            value = report[key]
            if isinstance(value, list):
                value = ", ".join(json.dumps(v) if isinstance(v, dict) else str(v) for v in value) or "none"
            lines.append(f"  {title}: {value}")
    if report["problems"]:
        lines.append("Problems:")
        lines += [f"  - {problem}" for problem in report["problems"]]
        lines.append("What to change:")
        lines += [f"  - {advice}" for advice in report["advice"]] or ["  - see the problems above"]
    else:
        lines.append("No problems found.")
    return "\n".join(lines)
