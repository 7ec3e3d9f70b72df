"""hivemind-dht's and hivemind-server's command lines, as `plexus dht` and `plexus server` take them:
the same flags and the same first lines (scripts parse them for the address to join)."""

import os
import re
import selectors
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(90)
LOCAL = "/ip4/127.0.0.1/tcp/0"
UNREACHABLE = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWPAwbPmHzkzFX9rsS3G9TtGnnAY37tvcr3jdtvJJMRCea"
DHT_START = re.compile(r"Running a DHT instance. To connect other peers to this one, use (.+)$")


def start(*args: str) -> subprocess.Popen:
    env = dict(os.environ, HIVEMIND_LOGLEVEL="INFO", PLEXUS_LOGLEVEL="INFO")
    return subprocess.Popen(
        [sys.executable, "-m", "plexus.cli.main", *args], stderr=subprocess.PIPE, text=True, env=env
    )


def read_line(process: subprocess.Popen, timeout: float = 40) -> str:
    selector = selectors.DefaultSelector()
    selector.register(process.stderr, selectors.EVENT_READ)
    if not selector.select(timeout):
        raise TimeoutError(f"no output within {timeout} s")
    return process.stderr.readline()


def stop(*processes: subprocess.Popen) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:  # a loaded machine; how a peer stops is test_dht_facade's job
            process.kill()
            process.wait()
        process.stderr.close()


def test_dht_command_prints_hiveminds_lines_and_peers_find_each_other():
    first = start("dht", "--host_maddrs", LOCAL, "--refresh_period", "1")
    second = None
    try:
        match = DHT_START.search(read_line(first))
        assert match is not None
        assert "Full list of visible multiaddresses:" in read_line(first)
        initial_peers = match.group(1).split(" ")
        assert initial_peers[0] == "--initial_peers"
        second = start("dht", *initial_peers, "--host_maddrs", LOCAL, "--refresh_period", "1")
        for _ in range(2):
            read_line(second)
        assert "2 DHT nodes (including this one) are in the local routing table" in read_line(second)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the first peer's next report counts the newcomer too
            if "2 DHT nodes (including this one)" in read_line(first):
                break
        else:
            raise AssertionError("the first peer never saw the second")
    finally:
        stop(first, *([second] if second else []))


def test_server_command_prints_its_dht_address_first(tmp_path):
    identity = tmp_path / "id"
    server = start(
        "server",
        "--num_experts",
        "1",
        "--hidden_dim",
        "4",
        "--num_handlers",
        "1",
        "--device",
        "cpu",
        "--host_maddrs",
        LOCAL,
        "--identity_path",
        str(identity),
    )
    try:
        assert "Generating new identity" in read_line(server)
        match = re.search(r"Running DHT node on \[(.+)\],", read_line(server))
        assert match is not None
        assert all(addr.startswith("/ip4/127.0.0.1/tcp/") for addr in match.group(1).split(", "))
    finally:
        stop(server)


def test_a_dht_that_cannot_bootstrap_exits_with_a_clear_error():
    process = start("dht", "--initial_peers", UNREACHABLE, "--host_maddrs", LOCAL)
    _, errors = process.communicate(timeout=60)
    assert process.returncode != 0 and "failed to connect to bootstrap peers" in errors
