"""`plexus server`: flags (real multiaddr lists, config files) and a real server process."""

import argparse
import json
import signal
import subprocess
import sys

import pytest
import torch

from plexus.cli import server as server_cli
from plexus.cli.config import parse_with_config
from plexus.dht.dht import DHT
from plexus.moe import get_experts

LOCAL = "/ip4/127.0.0.1/tcp/0"


def parse(argv):
    parser = argparse.ArgumentParser()
    server_cli.add_arguments(parser)
    return parse_with_config(parser, argv)


@pytest.mark.timeout(10)
def test_flags_take_real_lists_and_config_files(tmp_path):
    args = parse(
        ["--host_maddrs", "/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/2", "--expert_uids", "a.0", "a.1"]
    )
    assert args.host_maddrs == ["/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/2"]
    assert args.expert_uids == ["a.0", "a.1"] and args.initial_peers == [] and args.expert_cls == "ffn"
    assert args.hidden_dim == 1024 and args.max_batch_size == 16384 and args.update_period == 30.0
    config = tmp_path / "server.json"
    config.write_text(
        json.dumps(
            {
                "expert_pattern": "ffn.[0:4]",
                "num_experts": 2,
                "hidden_dim": 64,
                "announce_maddrs": ["/ip4/1.2.3.4/tcp/5"],
            }
        )
    )
    args = parse(["-c", str(config), "--hidden_dim", "32"])
    assert (args.expert_pattern, args.num_experts, args.hidden_dim) == ("ffn.[0:4]", 2, 32)
    assert args.announce_maddrs == ["/ip4/1.2.3.4/tcp/5"]
    config.write_text(json.dumps({"no_such_flag": 1}))
    with pytest.raises(SystemExit):
        parse(["--config", str(config)])


@pytest.mark.timeout(60)
def test_server_process_announces_serves_checkpoints_and_stops_on_ctrl_c(tmp_path):
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "plexus.cli.main",
            "server",
            "--expert_uids",
            "cli.0",
            "cli.1",
            "--hidden_dim",
            "8",
            "--host_maddrs",
            LOCAL,
            "--checkpoint_dir",
            str(tmp_path),
            "--optimizer",
            "sgd",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        while not lines or "--initial_peers" not in lines[-1]:
            line = process.stderr.readline()
            assert line, f"the server exited early: {''.join(lines)}"
            lines.append(line)
        addresses = lines[-1].split("--initial_peers", 1)[1].split()
        assert addresses and all(a.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in a for a in addresses)
        with DHT(initial_peers=addresses, start=True, client_mode=True) as client:
            experts = get_experts(client, ["cli.0", "cli.1", "cli.2"])
            assert experts[2] is None
            x = torch.randn(3, 8, requires_grad=True)
            experts[0](x).pow(2).sum().backward()
            assert x.grad is not None and torch.isfinite(x.grad).all()
        process.send_signal(signal.SIGINT)
        assert process.wait(20) == 0
        assert (tmp_path / "cli.0" / "checkpoint_last.pt").exists(), (
            "the last checkpoint is saved on the way out"
        )
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(5)
        process.stderr.close()
