"""The `plexus` command: help texts and the demo, run as a user would run them."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)


def plexus(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "plexus.cli.main", *args], capture_output=True, text=True, timeout=50
    )


def test_help_lists_the_commands():
    result = plexus("--help")
    assert result.returncode == 0 and "demo" in result.stdout


def test_demo_ping_only_pings_between_two_local_peers():
    result = plexus("demo", "--ping-only", "--pings", "2")
    assert result.returncode == 0, result.stderr
    assert "--initial_peers /ip4/127.0.0.1/tcp/" in result.stderr
    assert "ping 2/2" in result.stderr


def test_bad_arguments_get_a_clear_error():
    result = plexus("demo", "--pings", "many")
    assert result.returncode == 2 and "is not a whole number" in result.stderr


def test_demo_help_describes_the_albert_swarm():
    result = plexus("demo", "--help")
    assert result.returncode == 0
    assert (
        "--steps" in result.stdout
        and "client-mode trainer" in result.stdout
        and "--ping-only" in result.stdout
    )
