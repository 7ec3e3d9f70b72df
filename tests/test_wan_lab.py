"""The WAN lab: its delay line, profiles and scenarios without root; with root, its links measured
with plain TCP/UDP against their configured figures, Plexus (DHT and averaging) across them, and
clean-up after the scenario runner is killed.

The lab tests build network namespaces (plexus/testing/wan/lab.py); without root, iproute2 and
nftables they skip, except under CI=true, where they fail.
"""

import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plexus.errors import UsageError
from plexus.testing import wait_until
from plexus.testing.netns import emit, list_namespaces, namespace_pids
from plexus.testing.wan import PROFILES, LinkProfile, PathModel, WanLab
from plexus.testing.wan.__main__ import main as wan_cli
from plexus.testing.wan.forwarder import (
    GSO_TCPV4,
    NEEDS_CSUM,
    VNET_HEADER,
    DelayLine,
    split_tcp,
    tcp_segments,
)
from plexus.testing.wan.measure import MeasureOptions, PathProber, steady_rate
from plexus.testing.wan.profiles import parse_duration, parse_loss, parse_rate
from plexus.testing.wan.scenario import scenario_from_config
from tests.netns_support import require_lab

REPO = Path(__file__).resolve().parents[1]


def packet(src: str, dst: str, payload: bytes = b"") -> bytes:
    """An IPv4 header (only the version and addresses matter to the delay line) and a payload."""
    return bytes([0x45]) + bytes(11) + socket.inet_aton(src) + socket.inet_aton(dst) + payload


# --- the delay line: no I/O, virtual time ---------------------------------------------------------


def test_delay_line_holds_each_packet_for_its_paths_delay():
    line = DelayLine(
        [("10.0.0.1", "10.0.0.2", 0.030, 0.0, 0.0), ("10.0.0.2", "10.0.0.1", 0.010, 0.0, 0.0)], tick=1e-4
    )
    line.push(packet("10.0.0.1", "10.0.0.2", b"ab"), now=1.0)
    line.push(packet("10.0.0.2", "10.0.0.1", b"ba"), now=1.0)
    line.push(packet("10.0.0.9", "10.0.0.1", b"unknown"), now=1.0)
    assert [p[20:] for p in line.pop_due(1.0)] == [b"unknown"]  # no path: straight through
    assert line.next_deadline() == pytest.approx(1.010)
    assert line.pop_due(1.0099) == []
    assert [p[20:] for p in line.pop_due(1.0101)] == [b"ba"]
    assert line.pop_due(1.0299) == []
    assert [p[20:] for p in line.pop_due(1.0301)] == [b"ab"]
    assert line.next_deadline() is None and line.held == 0
    assert (line.received, line.delivered, line.unknown) == (3, 3, 1)


def test_delay_line_drops_at_the_paths_loss_rate():
    line = DelayLine([("10.0.0.1", "10.0.0.2", 0.0, 0.0, 0.1)], rng=random.Random(7))
    for _ in range(20000):
        line.push(packet("10.0.0.1", "10.0.0.2"), now=0.0)
    assert line.dropped + len(line.pop_due(1.0)) == 20000
    assert line.dropped / 20000 == pytest.approx(0.1, abs=5 * math.sqrt(0.1 * 0.9 / 20000))
    assert line.stats()["paths"]["10.0.0.1>10.0.0.2"] == [20000, line.dropped]


def test_jitter_spreads_delays_but_never_reorders_a_path():
    line = DelayLine([("10.0.0.1", "10.0.0.2", 0.050, 0.010, 0.0)], tick=1e-5, rng=random.Random(1))
    sent = {}
    for i in range(2000):  # 10 ms apart: wider than the jitter, so order rarely binds
        sent[i] = i * 0.010
        line.push(packet("10.0.0.1", "10.0.0.2", i.to_bytes(4, "big")), now=sent[i])
    released, now = [], 0.0
    while (deadline := line.next_deadline()) is not None:
        now = deadline
        released += [(int.from_bytes(p[20:], "big"), now) for p in line.pop_due(now)]
    order = [i for i, _ in released]
    assert order == sorted(order) and len(order) == 2000
    delays = [at - sent[i] for i, at in released]
    assert min(delays) >= 0.040 - 1e-5 and max(delays) <= 0.060 + 1e-5
    assert sum(delays) / len(delays) == pytest.approx(0.050, abs=0.001)
    # packets 1 ms apart: many would overtake their predecessor, and wait for it instead
    for i in range(200):
        line.push(packet("10.0.0.1", "10.0.0.2", i.to_bytes(4, "big")), now=100 + i * 0.001)
    burst = line.pop_due(200.0)
    assert [int.from_bytes(p[20:], "big") for p in burst] == list(range(200))


def test_delay_line_bounds_what_it_holds():
    line = DelayLine([("10.0.0.1", "10.0.0.2", 1.0, 0.0, 0.0)], max_held=10)
    for _ in range(15):
        line.push(packet("10.0.0.1", "10.0.0.2"), now=0.0)
    assert line.held == 10 and line.overflow == 5
    with pytest.raises(ValueError, match="loss"):
        DelayLine([("10.0.0.1", "10.0.0.2", 0.01, 0.0, 1.5)])


def super_packet(payload: bytes, segment: int, flags: int = 0x18 | 0x01 | 0x80) -> bytes:
    """A TCP super-packet as the TUN device hands it over with offloads: virtio-net header, IPv4
    header, TCP header (PSH|ACK|FIN|CWR by default), then `payload` for segments of `segment` bytes."""
    ip = bytearray(20)
    ip[0], ip[8], ip[9] = 0x45, 64, socket.IPPROTO_TCP
    ip[2:4] = (40 + len(payload)).to_bytes(2, "big")
    ip[4:6] = (0xFFFE).to_bytes(2, "big")  # the ids of the segments wrap around
    ip[12:20] = socket.inet_aton("10.0.0.1") + socket.inet_aton("10.0.0.2")
    tcp = bytearray(20)
    tcp[0:4] = (5000).to_bytes(2, "big") + (6000).to_bytes(2, "big")
    tcp[4:8] = (0xFFFFFF00).to_bytes(4, "big")  # and so do their sequence numbers
    tcp[12], tcp[13] = 5 << 4, flags
    vnet = VNET_HEADER.pack(NEEDS_CSUM, GSO_TCPV4, 40, segment, 20, 16)
    return vnet + bytes(ip) + bytes(tcp) + payload


def ones_complement_sum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data), 2))
    while total > 0xFFFF:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def test_a_super_packet_is_cut_into_the_segments_it_stands_for():
    payload = bytes(range(250))
    buffer = super_packet(payload, 100)
    assert tcp_segments(buffer) == 3
    pieces = split_tcp(buffer)
    assert [len(piece) - 10 - 40 for piece in pieces] == [100, 100, 50]
    assert b"".join(piece[50:] for piece in pieces) == payload
    for i, piece in enumerate(pieces):
        assert VNET_HEADER.unpack_from(piece) == (NEEDS_CSUM, 0, 0, 0, 20, 16)
        ip, tcp = piece[10:30], piece[30:]
        assert int.from_bytes(ip[2:4], "big") == len(piece) - 10
        assert int.from_bytes(ip[4:6], "big") == (0xFFFE + i) & 0xFFFF
        assert ones_complement_sum(ip) == 0xFFFF  # a valid IPv4 header checksum
        assert int.from_bytes(tcp[4:8], "big") == (0xFFFFFF00 + 100 * i) & 0xFFFFFFFF
        assert tcp[13] == {0: 0x10 | 0x80, 1: 0x10, 2: 0x18 | 0x01}[i]  # CWR first, FIN and PSH last
        # what the kernel does with NEEDS_CSUM: sum from the TCP header on, the partial sum included
        finished = (~ones_complement_sum(tcp)) & 0xFFFF
        pseudo = ip[12:20] + bytes([0, socket.IPPROTO_TCP]) + len(tcp).to_bytes(2, "big")
        zeroed = tcp[:16] + b"\0\0" + tcp[18:]
        assert finished == (~ones_complement_sum(pseudo + zeroed)) & 0xFFFF
    plain = bytes(VNET_HEADER.size) + packet("10.0.0.1", "10.0.0.2", b"x" * 40)
    assert tcp_segments(plain) == 1 and split_tcp(plain) == [plain]


def test_loss_is_drawn_per_segment_of_a_super_packet():
    line = DelayLine([("10.0.0.1", "10.0.0.2", 0.010, 0.0, 0.3)], rng=random.Random(2), header=10)
    for _ in range(200):
        line.push(super_packet(bytes(1000), 100), now=0.0)
    released = line.pop_due(1.0)
    segments = sum(tcp_segments(piece) for piece in released)
    assert segments + line.dropped == 2000
    assert line.stats()["paths"]["10.0.0.1>10.0.0.2"] == [2000, line.dropped]
    assert line.dropped / 2000 == pytest.approx(0.3, abs=5 * math.sqrt(0.3 * 0.7 / 2000))
    assert any(tcp_segments(piece) == 10 for piece in released)  # a burst without loss stays whole
    assert any(len(piece) == 10 + 40 + 100 for piece in released)  # one with loss is cut up


# --- profiles and scenarios ------------------------------------------------------------------------


def test_path_model_combines_both_links_and_bounds_tcp():
    home, notebook = PROFILES["home"], PROFILES["notebook"]
    path = PathModel(home, notebook)
    assert path.rtt == pytest.approx((0.030 + 0.080) / 2) and path.one_way == pytest.approx(path.rtt / 2)
    assert path.rate == 20e6  # home's uplink into the notebook's 50 Mbit/s downlink
    assert path.loss == pytest.approx(0.005)
    assert PathModel(notebook, notebook).loss == pytest.approx(1 - 0.995**2)
    assert PathModel(home, home).rtt == home.rtt  # two peers of one profile see exactly its figures
    # the Mathis bound: 1448 B / 55 ms * 1.22 / sqrt(0.005), about 3.7 Mbit/s, below the link
    assert path.mathis == pytest.approx(1448 * 8 / 0.055 * math.sqrt(1.5) / math.sqrt(0.005))
    assert path.tcp_bound == path.loss_bound < path.goodput < path.rate
    assert PathModel(home, notebook, congestion_control="bbr").tcp_bound == path.goodput
    assert PathModel(home, home).tcp_bound == pytest.approx(20e6 * 1448 / 1514)


def test_figures_read_like_people_write_them():
    assert parse_rate("100mbit") == 100e6 and parse_rate("1 Gbit/s") == 1e9 and parse_rate(5e6) == 5e6
    assert parse_duration("30ms") == pytest.approx(0.030) and parse_duration("1.5s") == 1.5
    assert parse_loss("0.5%") == pytest.approx(0.005) and parse_loss(0.01) == 0.01
    for bad in (lambda: parse_rate("fast"), lambda: parse_duration("soon"), lambda: parse_loss("-1")):
        with pytest.raises(UsageError):
            bad()


def test_scenario_config_names_peers_groups_and_pairs():
    scenario = scenario_from_config(
        {
            "mtu": 9000,
            "profiles": {"fiber": {"base": "home", "down": "1gbit", "up": "500mbit"}},
            "peers": {
                "server": "datacenter",
                "home": {"profile": "fiber", "count": 2},
                "laptop": {"profile": "notebook", "loss": "1%"},
                "phone": "notebook",
            },
            "measure": {"pairs": [["server", "home"], ["laptop", "phone"]], "tcp_seconds": 1},
            "run": [{"peers": ["home"], "command": "python peer.py"}],
        }
    )
    assert list(scenario.peers) == ["server", "home1", "home2", "laptop", "phone"]
    assert scenario.peers["home1"].down == 1e9 and scenario.peers["home1"].rtt == PROFILES["home"].rtt
    assert scenario.peers["laptop"].loss == 0.01 and scenario.peers["laptop"].nat
    assert scenario.pairs == [("server", "home1"), ("server", "home2")]  # two NATed peers: no direct path
    assert scenario.lab.mtu == 9000 and scenario.measure.tcp_seconds == 1
    program = scenario.programs[0]
    assert program.peers == ["home1", "home2"] and program.command == ["python", "peer.py"]
    assert scenario_from_config({"peers": {"a": "home", "b": "home"}}).pairs == [("a", "b")]  # the star


@pytest.mark.parametrize(
    "config, complaint",
    [
        ({}, "needs a \\[peers\\] table"),
        ({"peers": {"a": "fibre"}}, "unknown link profile 'fibre'"),
        ({"peers": {"a": {"profile": "home", "speed": 3}}}, "unknown field"),
        ({"peers": {"a": "home"}, "mtu": 100}, "mtu must be within"),
        ({"peers": {"a": "home"}, "colour": "red"}, "unknown key"),
        ({"peers": {"a": {"profile": "home", "count": 0}}}, "count must be a positive integer"),
        ({"peers": {"a": "home"}, "measure": {"pairs": [["a", "z"]]}}, "no peer or group 'z'"),
        ({"peers": {"a": "home"}, "profiles": {"x": {"down": "1gbit"}}}, "needs \\['rtt', 'up'\\]"),
        ({"peers": {"a": {"profile": "home", "loss": 2}}}, "loss must be within"),
        ({"peers": {"a": "home"}, "run": [{"command": []}]}, "command"),
    ],
)
def test_bad_scenarios_say_what_is_wrong(config, complaint):
    with pytest.raises(UsageError, match=complaint):
        scenario_from_config(config)


def test_steady_rate_leaves_out_slow_start_and_the_partial_last_bin():
    assert steady_rate([10, 100, 1000, 1000, 1000, 7], 0.1, warmup=0.2) == pytest.approx(1000 * 8 / 0.1)
    assert steady_rate([10, 7], 0.1, warmup=0.5) is None


# --- the lab on this machine ----------------------------------------------------------------------


MODEST = LinkProfile(down=20e6, up=20e6, rtt=0.040)
LOSSY = LinkProfile(down=10e6, up=5e6, rtt=0.080, jitter=0.004, loss=0.20, nat=True)


@pytest.mark.timeout(120)
def test_lab_links_deliver_their_configured_rtt_bandwidth_loss_and_jitter():
    """Plain TCP and UDP between namespaces, within 10% of the configured figures at modest rates."""
    require_lab(("ip", "tc", "nft"))
    with WanLab({"a": MODEST, "b": MODEST, "lossy": LOSSY}, seed=3) as lab:
        options = MeasureOptions(rtt_count=20, udp_count=1000, udp_interval=0.001, tcp_seconds=2)
        prober = PathProber(lab, options)
        clean = prober.measure("a", "b")
        assert clean.rtt == pytest.approx(0.040, rel=0.1)
        assert clean.one_way == pytest.approx(0.020, rel=0.1)
        assert clean.loss == 0
        assert clean.throughput == pytest.approx(lab.path("a", "b").goodput, rel=0.1)
        # 20% loss, 6000 datagrams: 10% of it is 3.9 standard deviations of the estimate
        many = MeasureOptions(rtt_count=5, udp_count=6000, udp_interval=0.00025, udp_size=64, tcp_seconds=0)
        up = prober.measure("lossy", "a", many)
        assert up.loss == pytest.approx(0.20, rel=0.1) and up.rtt == pytest.approx(0.060, rel=0.1)
        down = prober.measure("a", "lossy", many)  # measured from behind the NAT, with the data flowing in
        assert down.loss == pytest.approx(0.20, rel=0.1)
        sparse = MeasureOptions(rtt_count=0, udp_count=200, udp_interval=0.008, tcp_seconds=0)
        jittered = prober.measure("lossy", "b", sparse)  # 8 ms apart: the jitter's full spread shows
        assert jittered.one_way == pytest.approx(0.030, rel=0.1)
        assert jittered.jitter == pytest.approx(0.002, rel=0.5)  # busy machines delay a few packets more
        assert min(jittered.delays) >= 0.028 - 1e-4
        assert "unreachable" in lab.run("a", sys.executable, "-c", CONNECT % (lab.address("lossy"), 9))
        stats = lab.forwarder_stats()
        assert stats["tun_dropped"] == 0 and stats["overflow"] == 0, stats
        prober.close()


CONNECT = """
import socket
s = socket.socket(); s.settimeout(2)
try:
    s.connect((%r, %d)); print("connected")
except OSError as error:
    print("unreachable", error)
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_plexus_dht_and_averaging_across_lab_links():
    """Three peers on different links (one lossy) find each other's records and average together."""
    require_lab(("ip", "tc", "nft"))
    lossy_notebook = PROFILES["notebook"].replace(nat=False)
    peers = {"first": "home", "second": lossy_notebook, "third": MODEST}
    with WanLab(peers, seed=5) as lab:
        env = dict(os.environ, PYTHONUNBUFFERED="1")

        def start(name, *args):
            argv = [sys.executable, "-m", "tests.test_wan_lab", name, lab.address(name), *args]
            return lab.peer(name, argv, env=env, cwd=str(REPO))

        first = start("first")
        maddr = first.wait_for("ready", 60)["maddr"]
        others = [start(name, maddr) for name in ("second", "third")]
        results = [peer.wait_for("done", 120) for peer in (first, *others)]
    for result in results:
        assert result["values"] == {name: f"from {name}" for name in peers}, result
        assert result["averaged"] == pytest.approx(2.0), result  # the mean of 1, 2 and 3
        assert result["group_size"] == 3, result


def lab_peer_main(argv: list[str]) -> None:
    """A Plexus peer in a lab namespace: stores a record, reads everyone's, then averages once."""
    import torch

    from plexus.averaging.averager import DecentralizedAverager
    from plexus.dht.dht import DHT
    from plexus.utils.logging import use_plexus_log_handler
    from plexus.utils.timing import get_dht_time

    use_plexus_log_handler("WARNING", stream=sys.stderr)
    me, ip, initial = argv[0], argv[1], argv[2:]
    names = ["first", "second", "third"]
    dht = DHT(initial_peers=initial, host_maddrs=[f"/ip4/{ip}/tcp/0"], start=True)
    emit("ready", maddr=str(dht.get_visible_maddrs()[0]))
    dht.store(f"wan_{me}", f"from {me}", get_dht_time() + 300)
    values = {}

    def all_found() -> bool:
        for name in names:
            if name not in values and (found := dht.get(f"wan_{name}", latest=True)) is not None:
                values[name] = found.value
        return len(values) == len(names)

    wait_until(all_found, timeout=60, interval=0.2, message="every peer's record is found")
    tensor = torch.full((1000,), float(names.index(me) + 1))
    averager = DecentralizedAverager(
        [tensor],
        dht,
        prefix="wanlab",
        target_group_size=3,
        min_matchmaking_time=3.0,
        request_timeout=3.0,
        start=True,
    )
    group = averager.step(timeout=90)
    with averager.get_tensors() as tensors:
        averaged = float(tensors[0].mean())
    emit("done", values=values, averaged=averaged, group_size=len(group or {}))
    averager.shutdown()
    dht.shutdown()


# --- clean-up when the scenario runner is killed ----------------------------------------------------


KILL_SCENARIO = """
[peers]
server = "home"
laptop = "notebook"
[[run]]
peers = ["server", "laptop"]
command = ["python", "-c", "import sys; print('up', flush=True); sys.stdin.read()"]
timeout = 120
"""


def _start_scenario(tmp_path) -> tuple[subprocess.Popen, str, dict[str, list[int]]]:
    """Run a scenario whose programs wait forever; return it, its namespace tag and their pids."""
    path = tmp_path / "scenario.toml"
    path.write_text(KILL_SCENARIO)
    runner = subprocess.Popen(
        [sys.executable, "-m", "plexus.testing.wan", str(path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = runner.stdout.readline()  # "lab pxwan-<pid>-0-* is up: ..."
    assert " is up:" in line, (line, runner.stderr.read() if runner.poll() is not None else "")
    tag = line.split()[1].rstrip("*")
    deadline = time.monotonic() + 60
    while True:  # both programs and the forwarder are running once every namespace shows them
        pids = {name: namespace_pids(name) for name in list_namespaces() if name.startswith(tag)}
        peers = [name for name in pids if name.rsplit("-", 1)[1] in ("p1", "p2")]
        if len(peers) == 2 and all(pids[name] for name in peers) and pids.get(tag + "core"):
            return runner, tag, pids
        assert time.monotonic() < deadline, f"the scenario's processes did not show up: {pids}"
        time.sleep(0.1)  # poll the namespaces with a deadline


def _running(pid: int) -> bool:
    """Whether the process exists and is not a zombie (an ended child its new parent has yet to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _assert_nothing_left(tag: str, pids: dict[str, list[int]]) -> None:
    assert not [name for name in list_namespaces() if name.startswith(tag)]
    every = [pid for group in pids.values() for pid in group]
    wait_until(
        lambda: not any(map(_running, every)), timeout=10, message=f"the lab's processes {every} have ended"
    )


@pytest.mark.timeout(120)
def test_a_stopped_or_killed_scenario_leaves_nothing_behind(tmp_path, capsys):
    require_lab(("ip", "tc", "nft"))
    runner, tag, pids = _start_scenario(tmp_path)
    runner.send_signal(signal.SIGTERM)  # SIGINT and SIGHUP take the same handler
    assert runner.wait(timeout=30) == 128 + signal.SIGTERM
    assert "the lab was removed" in runner.stderr.read()
    _assert_nothing_left(tag, pids)

    runner, tag, pids = _start_scenario(tmp_path)
    runner.kill()  # SIGKILL: no handler runs; children die with their parent, namespaces stay
    runner.wait(timeout=30)
    assert [name for name in list_namespaces() if name.startswith(tag)]
    assert wan_cli(["--cleanup"]) == 0  # what the next scenario also does before it builds
    assert tag in capsys.readouterr().out
    _assert_nothing_left(tag, pids)


if __name__ == "__main__":
    lab_peer_main(sys.argv[1:])
