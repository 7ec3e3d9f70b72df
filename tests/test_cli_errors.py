"""Mistakes on the `plexus` command line get a short message that names the problem, exit status 2,
and a traceback only with --debug; `--version` and `--help` answer without loading torch."""

import json
import os
import socket
import subprocess
import sys

import pytest

from plexus.version import __version__

pytestmark = pytest.mark.timeout(120)
UNREACHABLE = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWPAwbPmHzkzFX9rsS3G9TtGnnAY37tvcr3jdtvJJMRCea"


def plexus(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key != "PLEXUS_LOGLEVEL"}
    return subprocess.run(
        [sys.executable, "-m", "plexus.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=100,
        env={**environment, **env},
    )


def assert_usage_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["dht", "--initial_peers", "1.2.3.4:31337"], ["--initial_peers", "must start with '/'"]),
        (["dht", "--initial_peers", "/ip4/1.2.3.4/tcp/99999"], ["--initial_peers", "port 99999"]),
        (["dht", "--host_maddrs", "/ip4/300.0.0.1/tcp/0"], ["--host_maddrs", "300.0.0.1"]),
        (["dht", "--refresh_period", "0"], ["--refresh_period", "above 0"]),
        (["dht", "--identity_path", "/"], ["--identity_path", "is a directory"]),
        (["doctor", "--peer", "/ip4/127.0.0.1/tcp/5"], ["--peer", "/p2p/<peer id>"]),
        (["doctor", "--peer", UNREACHABLE, "--timeout", "-1"], ["--timeout"]),
        (["demo", "--steps", "0"], ["--steps", "at least 1"]),
        (["demo", "--trainers", "two"], ["--trainers", "not a whole number"]),
        (["demo", "--host", "localhost:80"], ["--host", "not an IP address"]),
        (["server", "--hidden_dim", "-4"], ["--hidden_dim"]),
        (["server", "--custom_module_path", "no_such_file.py"], ["--custom_module_path", "does not exist"]),
        (["server"], ["--expert_uids", "--num_experts"]),
        (["server", "--expert_pattern", "ffn.[4:0]", "--num_experts", "2"], ["--expert_pattern", "empty"]),
        (
            ["server", "--expert_uids", "ffn.0", "--min_batch_size", "9", "--max_batch_size", "8"],
            ["--min_batch_size"],
        ),
        (["server", "--expert_uids", "ffn.0", "--scheduler", "linear"], ["--num_warmup_steps"]),
        (["server", "--expert_uids", "ffn.0", "--device", "gpu7"], ["--device"]),
        (["no_such_command"], ["invalid choice"]),
    ],
)
def test_bad_flags_get_a_short_message_and_status_2(args, fragments):
    assert_usage_error(plexus(*args), *fragments)


def test_bad_config_files_name_the_file_and_the_problem(tmp_path):
    missing = tmp_path / "missing.json"
    assert_usage_error(plexus("dht", "--config", str(missing)), str(missing), "does not exist")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert_usage_error(plexus("dht", "--config", str(broken)), str(broken), "not valid JSON", "line 1")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"refresh_period": -1, "initial_peers": []}))
    assert_usage_error(plexus("dht", "--config", str(wrong)), "refresh_period", "above 0")
    peers = tmp_path / "peers.json"
    peers.write_text(json.dumps({"initial_peers": ["not-an-address"]}))
    assert_usage_error(plexus("dht", "--config", str(peers)), "initial_peers", "must start with '/'")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("refresh_perod = 3\n")
    assert_usage_error(plexus("dht", "--config", str(unknown)), "refresh_perod")


def test_a_corrupt_identity_file_is_named_and_the_traceback_comes_with_debug(tmp_path):
    key = tmp_path / "peer.key"
    key.write_bytes(b"not a key at all")
    args = ("dht", "--identity_path", str(key), "--host_maddrs", "/ip4/127.0.0.1/tcp/0")
    assert_usage_error(plexus(*args), str(key), "private key")
    for result in (plexus(*args, "--debug"), plexus(*args, PLEXUS_LOGLEVEL="DEBUG")):
        assert result.returncode == 2 and "Traceback" in result.stderr and str(key) in result.stderr


def test_a_port_in_use_names_the_flag_to_change():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = plexus("dht", "--host_maddrs", f"/ip4/127.0.0.1/tcp/{port}")
    assert_usage_error(result, str(port), "--host_maddrs")


def test_a_swarm_that_cannot_be_joined_fails_with_status_1_and_no_traceback():
    result = plexus("dht", "--initial_peers", UNREACHABLE, "--host_maddrs", "/ip4/127.0.0.1/tcp/0")
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and "connection refused" in result.stderr


def test_version_is_the_package_version():
    for command in (
        [sys.executable, "-m", "plexus", "--version"],
        [sys.executable, "-m", "plexus.cli.main", "--version"],
    ):
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and result.stdout.strip() == f"plexus {__version__}"


def test_help_loads_neither_torch_nor_the_subcommands():
    code = (
        "import sys\n"
        "from plexus.cli.main import run\n"
        "try:\n    run(['--help'])\nexcept SystemExit as done:\n    assert done.code == 0\n"
        "loaded = [name for name in ('torch', 'plexus.cli.server', 'plexus.cli.dht', 'plexus.dht') if name in sys.modules]\n"
        "print(loaded)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("[]"), result.stdout


def test_import_plexus_defers_scipy_and_the_training_stack():
    code = (
        "import sys, plexus\n"
        "print([name for name in ('scipy.optimize', 'plexus.optim', 'plexus.moe', 'pydantic') if name in sys.modules])\n"
        "assert plexus.DHT.__name__ == 'DHT' and plexus.Optimizer.__name__ == 'Optimizer'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "albert")


@pytest.mark.parametrize(
    "script, args, fragments",
    [
        ("run_trainer.py", ["--initial_peers", "1.2.3.4:5"], ["--initial_peers", "must start with '/'"]),
        ("run_trainer.py", ["--target_batch_size", "0"], ["--target_batch_size", "at least 1"]),
        ("run_trainer.py", ["--dataset_path", "no_such_folder"], ["no_such_folder", "tokenize_corpus.py"]),
        ("run_training_monitor.py", ["--refresh_period", "0"], ["--refresh_period", "above 0"]),
        ("run_training_monitor.py", ["--host_maddrs", "/ip4/1.2.3.4/tcp/70000"], ["--host_maddrs", "70000"]),
        ("tokenize_corpus.py", ["--input_path", "no_such_corpus"], ["--input_path", "make_demo_corpus.py"]),
        ("train_local.py", ["--data_dir", "no_such_folder"], ["no_such_folder", "meta.json"]),
        ("make_demo_corpus.py", ["--packages", "no_such_package_here"], ["--packages", "not installed"]),
        ("run_demo.py", ["--steps", "many"], ["--steps", "many"]),
    ],
)
def test_example_scripts_report_bad_input_in_two_lines_with_status_2(tmp_path, script, args, fragments):
    pytest.importorskip("transformers")
    result = subprocess.run(
        [sys.executable, os.path.join(EXAMPLE, script), *args],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
        env={key: value for key, value in os.environ.items() if key != "PLEXUS_LOGLEVEL"},
    )
    assert_usage_error(result, *fragments)
