"""The dashboard's HTTP API over a real local swarm, read with aiohttp's client; hostile queries too."""

import argparse
import asyncio
import re
import socket
import subprocess
import sys
import time

import pytest

from plexus.cli import dht as dht_command
from plexus.cli.main import run as cli_run
from plexus.dht.crypto import Ed25519SignatureValidator
from plexus.dht.dht import DHT
from plexus.errors import UsageError
from plexus.optim.progress_tracker import ProgressTracker, progress_validators
from plexus.utils.logging import remove_plexus_log_handler
from plexus.utils.timing import get_dht_time

aiohttp = pytest.importorskip("aiohttp", reason="the dashboard needs aiohttp: pip install plexus[dashboard]")
from plexus.dashboard import Dashboard  # noqa: E402

pytestmark = pytest.mark.timeout(60)
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
FAST = dict(min_refresh_period=0.05, max_refresh_period=0.5, default_refresh_period=0.2)


@pytest.fixture(scope="module")
def swarm():
    """A DHT serving the dashboard and a trainer's DHT with a progress tracker reporting to it."""
    monitor = DHT(start=True, host_maddrs=LOCAL)
    trainer = DHT(initial_peers=monitor.get_visible_maddrs(), start=True, host_maddrs=LOCAL)
    tracker = ProgressTracker(trainer, "run", target_batch_size=100, **FAST)
    tracker.report_local_progress(0, 25)
    dashboard = Dashboard(monitor, "run", refresh_period=0.2, target_batch_size=100)
    yield dashboard, trainer
    dashboard.shutdown()
    tracker.shutdown()
    trainer.shutdown()
    monitor.shutdown()


async def fetch(url: str, method: str = "GET"):
    async with aiohttp.ClientSession() as session, session.request(method, url) as response:
        return response.status, response.headers, await response.text()


async def state_when(url: str, predicate, timeout: float = 15.0) -> dict:
    """Poll /api/state until `predicate(state)` holds (under a deadline)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(url + "api/state") as response:
                assert response.status == 200
                state = await response.json()
            if predicate(state):
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"the dashboard never showed what was expected; last state: {state}")
            await asyncio.sleep(0.1)  # polling under a deadline


def test_the_api_shows_the_trainer_and_this_node(swarm):
    dashboard, trainer = swarm
    trainer_id = str(trainer.peer_id)

    def trains(state):
        return any(p["peer_id"] == trainer_id and p["status"] == "training" for p in state["peers"])

    state = asyncio.run(state_when(dashboard.url, trains))
    row = next(p for p in state["peers"] if p["peer_id"] == trainer_id)
    assert row["epoch"] == 0 and row["samples_accumulated"] == 25 and row["nat"] == "direct"
    assert row["client_mode"] is False and any("/tcp/" in addr for addr in row["addresses"])
    assert state["swarm"]["trainers"] == 1 and state["swarm"]["samples_accumulated"] == 25
    assert state["swarm"]["target_batch_size"] == 100 and state["run_id"] == "run"
    assert state["node"]["peer_id"] == str(dashboard.dht.peer_id)


def test_a_forged_record_is_counted_and_its_signer_named_in_the_warnings(swarm):
    dashboard, _ = swarm
    forger = DHT(initial_peers=dashboard.dht.get_visible_maddrs(), start=True, host_maddrs=LOCAL)
    try:
        signer = Ed25519SignatureValidator(forger.private_key)
        forger.add_validators(progress_validators("run", signer))
        future = get_dht_time() + 3600  # storing nodes cannot tell; readers, with a clock, can
        record = dict(
            peer_id=forger.peer_id.to_bytes(),
            epoch=99,
            samples_accumulated=1,
            samples_per_second=1.0,
            time=future,
            client_mode=False,
        )
        assert forger.store("run_progress", record, future + 60, subkey=signer.local_public_key)

        def warned(state):  # the trainer's tracker in this process warns too: wait for the count
            named = any(str(forger.peer_id) in w["message"] for w in state["warnings"])
            return named and state["swarm"]["ignored_records"] >= 1

        state = asyncio.run(state_when(dashboard.url, warned))
        assert state["swarm"]["epoch"] == 0
        dashboard_warnings = [w for w in state["warnings"] if w["logger"] == "plexus.dashboard.server"]
        assert any("ahead of ours" in w["message"] for w in dashboard_warnings), state["warnings"]
        assert all(p["peer_id"] != str(forger.peer_id) or p["status"] != "training" for p in state["peers"])
    finally:
        forger.shutdown()


def test_the_page_and_its_assets_come_from_the_package(swarm):
    dashboard, _ = swarm
    status, headers, page = asyncio.run(fetch(dashboard.url))
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "/assets/app.js" in page and "http" not in re.sub(r'"http://www.w3.org[^"]*"', "", page)
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    status, headers, script = asyncio.run(fetch(dashboard.url + "assets/app.js"))
    assert status == 200 and "javascript" in headers["Content-Type"] and "/api/state" in script
    assert asyncio.run(fetch(dashboard.url + "assets/style.css"))[0] == 200


@pytest.mark.parametrize(
    "path, status",
    [
        ("api/state?history=abc", 400),
        ("api/state?history=-1", 400),
        ("api/state?history=1&history=2", 400),
        ("api/state?history=%C2%B2", 400),  # a unicode digit is not a number of points
        ("api/state?history=" + "9" * 5000, 400),
        ("api/state?drop=tables", 400),
        ("api/state?history=99999", 200),  # more than is kept: all that is kept
        ("assets/server.py", 404),
        ("assets/..%2fserver.py", 404),
        ("assets/index.html", 404),
        ("nothing/here", 404),
    ],
)
def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(swarm, path, status):
    dashboard, _ = swarm
    got, headers, body = asyncio.run(fetch(dashboard.url + path))
    assert got == status, body
    if status == 400:
        assert headers["Content-Type"].startswith("application/json") and '"error"' in body
    assert asyncio.run(fetch(dashboard.url + "api/state?history=2"))[0] == 200


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
def test_nothing_writes(swarm, method):
    dashboard, _ = swarm
    assert asyncio.run(fetch(dashboard.url + "api/state", method))[0] == 405


def test_a_missing_aiohttp_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "aiohttp", None)
    with pytest.raises(UsageError, match=r"pip install plexus\[dashboard\]"):
        Dashboard(dht=None)


def test_plexus_dht_without_aiohttp_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "aiohttp", None)
    try:
        assert cli_run(["dht", "--dashboard", "0"]) == 2  # a usage error, before any DHT starts
    finally:
        remove_plexus_log_handler()
    assert "error: the dashboard needs aiohttp: pip install plexus[dashboard]" in capsys.readouterr().err


def test_a_taken_port_is_a_clear_error(swarm):
    dashboard, trainer = swarm
    with pytest.raises(UsageError, match="cannot listen on 127.0.0.1:"):
        Dashboard(trainer, host="127.0.0.1", port=dashboard.port)


def test_plexus_dht_serves_the_dashboard():
    with socket.socket() as probe:  # a free port for the command to bind
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "plexus.cli.main", "dht", "--host_maddrs", *LOCAL]
    process = subprocess.Popen(
        [*command, "--dashboard", f"127.0.0.1:{port}", "--run_id", "run"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        for line in process.stderr:  # the URL is logged once the server listens
            lines.append(line)
            if "Dashboard: " in line:
                break
        assert f"Dashboard: http://127.0.0.1:{port}/" in "".join(lines), "".join(lines)
        state = asyncio.run(state_when(f"http://127.0.0.1:{port}/", lambda s: s["node"] is not None))
        assert state["run_id"] == "run" and state["node"]["addresses"]
    finally:
        process.terminate()
        assert process.wait(30) == 0


def test_a_bad_dashboard_flag_is_a_usage_error(capsys):
    parser = argparse.ArgumentParser(prog="plexus dht")
    dht_command.add_arguments(parser)
    assert parser.parse_args(["--dashboard", "0.0.0.0:8080"]).dashboard == ("0.0.0.0", 8080)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--dashboard", "nope"])
    assert exit_info.value.code == 2 and "expected a number from 0 to 65535" in capsys.readouterr().err
