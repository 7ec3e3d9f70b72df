"""The ALBERT example as a swarm: LAMB, the trainers' metrics, the Trainer glue, the loss plot, then
monitor and trainers as real processes on 127.0.0.1, and the demo command itself.

The end-to-end tests use the small fixture corpus (a 300-token BPE, 32-token samples) so that the
tiny model steps in milliseconds and each global step costs little more than its averaging.
"""

import csv
import json
import math
import os
import re
import struct
import subprocess
import sys
import urllib.request
import zlib

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "albert")
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "albert")

from plexus.errors import UsageError  # noqa: E402
from plexus.examples.albert import metrics, plot  # noqa: E402
from plexus.examples.albert.lamb import Lamb  # noqa: E402


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("albert_swarm") / "albert_tokenized")
    result = subprocess.run(
        [
            sys.executable,
            "tokenize_corpus.py",
            "--input_path",
            FIXTURES,
            "--output_dir",
            out,
            "--tokenizer_type",
            "bpe",
            "--vocab_size",
            "300",
            "--seq_length",
            "32",
            "--seed",
            "1",
        ],
        cwd=EXAMPLE,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"),
    )
    assert result.returncode == 0, result.stderr
    return out


# --- LAMB --------------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_lamb_first_step_is_adams_direction_scaled_by_the_trust_ratio():
    weight = torch.nn.Parameter(torch.tensor([3.0, -4.0]))
    weight.grad = torch.tensor([0.5, 0.1])
    Lamb([weight], lr=0.1, weight_decay=0.01, eps=0.0, debias=True).step()
    # debiased first step: m/sqrt(v) = sign(g); plus decay; scaled by ||w|| / ||update||
    update = torch.tensor([1.0, 1.0]) + 0.01 * torch.tensor([3.0, -4.0])
    expected = torch.tensor([3.0, -4.0]) - 0.1 * (5.0 / update.norm()) * update
    assert torch.allclose(weight.detach(), expected, atol=1e-6)


@pytest.mark.timeout(10)
def test_lamb_takes_plain_steps_for_zero_tensors_and_caps_large_norms():
    zero = torch.nn.Parameter(torch.zeros(2))
    zero.grad = torch.tensor([1.0, -1.0])
    Lamb([zero], lr=0.1, eps=0.0, debias=True).step()
    assert torch.allclose(zero.detach(), torch.tensor([-0.1, 0.1]))  # ratio 1
    big = torch.nn.Parameter(torch.full((4,), 100.0))  # norm 200, capped at 10
    big.grad = torch.ones(4)
    Lamb([big], lr=0.1, eps=0.0, debias=True, clamp_value=10.0).step()
    assert torch.allclose(big.detach(), torch.full((4,), 100.0 - 0.1 * 10.0 / 2.0))


@pytest.mark.timeout(20)
def test_lamb_fits_a_regression():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = Lamb(model.parameters(), lr=0.05, debias=True)
    inputs = torch.randn(256, 8)
    targets = inputs @ torch.linspace(-1, 1, 8).unsqueeze(1)
    losses = []
    for _ in range(200):
        loss = ((model(inputs) - targets) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.05 * losses[0]


# --- metrics ------------------------------------------------------------------------------------------


def entry(step: int, loss: float, mini_steps: int = 2, samples: int = 64, speed: float = 10.0):
    return metrics.StepMetrics(
        step=step,
        loss=loss,
        mini_steps=mini_steps,
        samples_accumulated=samples,
        samples_per_second=speed,
        time=1000.0 + step,
    )


def local(peer: str, *entries):
    return metrics.LocalMetrics(peer_id=peer, client_mode=False, history=list(entries))


@pytest.mark.timeout(10)
def test_step_table_waits_for_late_reports_then_emits_each_step_once_in_order():
    table = metrics.StepTable(settle_time=5.0)
    assert table.update({"a": local("a", entry(1, 9.0))}, now=0.0) == []
    # b reports step 1 late, with more micro-batches: it weighs more in the mean
    assert (
        table.update(
            {"a": local("a", entry(1, 9.0), entry(2, 8.0)), "b": local("b", entry(1, 6.0, mini_steps=4))},
            now=3.0,
        )
        == []
    )
    rows = table.update({"a": local("a", entry(1, 9.0), entry(2, 8.0))}, now=5.0)
    assert [(r.step, r.alive_peers, r.samples, r.samples_per_second) for r in rows] == [(1, 2, 128, 20.0)]
    assert rows[0].loss == pytest.approx((9.0 * 2 + 6.0 * 4) / 6)
    # step 1 is done: repeating it in the history changes nothing; step 2 settles later
    assert table.update({"a": local("a", entry(1, 1.0), entry(2, 8.0))}, now=7.0) == []
    assert [r.step for r in table.update({}, now=8.0)] == [2]
    table.update({"b": local("b", entry(3, 7.0))}, now=9.0)
    assert [r.step for r in table.flush()] == [3] and table.peers_seen == {"a", "b"}


@pytest.mark.timeout(10)
def test_metric_records_are_strict():
    record = local("peer", entry(1, 9.0))
    assert metrics.LocalMetrics.model_validate(record.model_dump()) == record
    for bad in (dict(loss=math.nan), dict(step=0), dict(mini_steps=0), dict(loss="9.0")):
        with pytest.raises(ValueError):
            metrics.StepMetrics.model_validate({**entry(1, 9.0).model_dump(), **bad})
    with pytest.raises(ValueError):
        local("peer", *[entry(i, 9.0) for i in range(1, metrics.HISTORY + 2)])


@pytest.mark.timeout(30)
def test_trainers_metrics_travel_signed_through_the_dht():
    import plexus

    first = plexus.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = plexus.DHT(
        initial_peers=first.get_visible_maddrs(), start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"]
    )
    try:
        keys = {}
        for dht in (first, second):
            validators, keys[dht] = metrics.make_validators("run", dht.private_key)
            dht.add_validators(validators)
        record = local(str(first.peer_id), entry(1, 9.0))
        expiration = plexus.get_dht_time() + 60
        assert first.store(metrics.metrics_key("run"), record.model_dump(), expiration, subkey=keys[first])
        assert metrics.parse_records(second.get(metrics.metrics_key("run"), latest=True)) == {
            str(first.peer_id): record
        }
        # nobody writes under another peer's key, and malformed values are refused
        assert not second.store(
            metrics.metrics_key("run"), record.model_dump(), expiration, subkey=keys[first]
        )
        assert not second.store(metrics.metrics_key("run"), {"loss": 1.0}, expiration, subkey=keys[second])
    finally:
        second.shutdown()
        first.shutdown()


# --- the Trainer glue -------------------------------------------------------------------------------


class FakeOptimizer:
    def __init__(self, model, heal: bool):
        self.model, self.heal, self.local_epoch, self.loads = model, heal, 0, 0
        self.tracker = type(
            "Tracker", (), {"performance_ema": type("EMA", (), {"samples_per_second": 12.5})()}
        )()
        self.param_groups = [{"lr": 0.01, "params": list(model.parameters())}]

    def load_state_from_peers(self):
        self.loads += 1
        if self.heal:
            with torch.no_grad():
                for param in self.model.parameters():
                    param.copy_(torch.ones_like(param))
            self.local_epoch = 7


class FakeDHT:
    peer_id = "QmFakePeer"

    def __init__(self):
        self.stored = []

    def store(self, key, value, expiration_time, subkey=None, return_future=False):
        self.stored.append((key, value, subkey))


def make_callback(heal: bool = True):
    from plexus.examples.albert.collaboration import LossMeter, SwarmCallback

    model = torch.nn.Linear(2, 1)
    optimizer, dht = FakeOptimizer(model, heal), FakeDHT()
    callback = SwarmCallback(
        dht=dht,
        optimizer=optimizer,
        model=model,
        run_id="run",
        subkey=b"[owner:x]",
        client_mode=False,
        batch_size_per_step=16,
        losses=LossMeter(),
    )
    return callback, model, optimizer, dht


@pytest.mark.timeout(10)
def test_callback_replaces_non_finite_parameters_by_the_swarms_state():
    callback, model, optimizer, _ = make_callback(heal=True)
    with torch.no_grad():
        model.weight[0, 0] = math.nan
    callback.on_step_end(None, None, None)
    assert optimizer.loads == 1 and callback.parameters_are_finite() and callback.last_epoch == 7

    callback, model, optimizer, _ = make_callback(heal=False)
    with torch.no_grad():
        model.bias.fill_(math.inf)
    with pytest.raises(SystemExit, match="non-finite"):
        callback.on_step_end(None, None, None)


@pytest.mark.timeout(10)
def test_callback_publishes_each_epoch_it_took_part_in():
    callback, _, optimizer, dht = make_callback()
    for loss in (6.0, 8.0):
        callback.losses.add(loss)
        callback.on_step_end(None, None, None)
    assert dht.stored == []  # still epoch 0
    optimizer.local_epoch = 1
    callback.on_step_end(None, None, None)
    key, value, subkey = dht.stored[-1]
    assert key == "run_metrics" and subkey == b"[owner:x]"
    published = metrics.LocalMetrics.model_validate(value)
    assert [(e.step, e.loss, e.mini_steps, e.samples_accumulated) for e in published.history] == [
        (1, 7.0, 2, 48)
    ]
    optimizer.local_epoch = 5  # caught up by loading state: not our step, nothing published
    callback.losses.add(5.0)
    callback.on_step_end(None, None, None)
    assert len(dht.stored) == 1


@pytest.mark.timeout(10)
def test_noop_scheduler_reports_the_optimizers_rate_and_steps_nothing():
    from plexus.examples.albert.collaboration import NoOpScheduler

    _, _, optimizer, _ = make_callback()
    scheduler = NoOpScheduler(optimizer)
    scheduler.step()
    assert scheduler.get_last_lr() == [0.01] and scheduler.state_dict() == {}


# --- the plot ---------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_loss_plot_is_a_valid_png(tmp_path):
    path = str(tmp_path / "loss.png")
    plot.write_line_plot(
        path,
        [1, 2, 3, 4],
        [9.0, 8.1, 7.5, 7.2],
        title="MLM loss",
        x_label="global step",
        width=200,
        height=120,
    )
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    idat = data.index(b"IDAT")
    length = struct.unpack(">I", data[idat - 4 : idat])[0]
    pixels = zlib.decompress(data[idat + 4 : idat + 4 + length])
    assert (width, height) == (200, 120) and len(pixels) == height * (1 + 3 * width)
    assert bytes((31, 119, 180)) in pixels  # the curve was drawn
    assert plot.nice_ticks(6.7, 9.03) == [6.5, 7.0, 7.5, 8.0, 8.5, 9.0, 9.5]


# --- the swarm, end to end -------------------------------------------------------------------------


def read_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


FAKE_WANDB = """import json, os
def _write(kind, data):
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps([kind, data]) + "\\n")
def init(**kwargs): _write("init", kwargs)
def log(data): _write("log", data)
def finish(): _write("finish", {})
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_monitor_and_trainers_train_together_and_a_late_trainer_catches_up(tokenized, tmp_path):
    from plexus.examples.albert.swarm import LocalSwarm

    (tmp_path / "fake" / "wandb").mkdir(parents=True)
    (tmp_path / "fake" / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    metrics_path, wandb_log = str(tmp_path / "metrics.csv"), str(tmp_path / "wandb.jsonl")
    trainer_flags = [
        "--dataset_path",
        tokenized,
        "--config",
        "tiny",
        "--target_batch_size",
        "32",
        "--per_device_train_batch_size",
        "8",
        "--learning_rate",
        "0.05",
        "--warmup_steps",
        "2",
        "--matchmaking_time",
        "1",
        "--averaging_timeout",
        "20",
        "--overwrite_output_dir",
        "--save_steps",
        "1000000",
        "--disable_tqdm",
        "true",
        "--report_to",
        "none",
        "--host_maddrs",
        "/ip4/127.0.0.1/tcp/0",
    ]

    def trainer(name: str) -> list[str]:
        return [
            *trainer_flags,
            "--initial_peers",
            *peers,
            "--output_dir",
            str(tmp_path / name),
            "--logging_dir",
            str(tmp_path / name / "logs"),
        ]

    def steps_done() -> list[int]:
        return [int(row["step"]) for row in read_rows(metrics_path)]

    with LocalSwarm(str(tmp_path / "run")) as swarm:
        peers = swarm.start_monitor(
            "--host_maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--refresh_period",
            "0.5",
            "--settle_time",
            "1.5",
            "--metrics_path",
            metrics_path,
            "--wandb_project",
            "plexus-test",
            "--store_checkpoints",
            "--save_checkpoint_step_interval",
            "3",
            "--checkpoint_dir",
            str(tmp_path / "checkpoints"),
            "--config",
            "tiny",
            "--dataset_path",
            tokenized,
            "--dashboard",
            "127.0.0.1:0",
            env=dict(
                PYTHONPATH=os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]),
                FAKE_WANDB_LOG=wandb_log,
            ),
        )
        assert all(peer.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in peer for peer in peers)
        swarm.start("first", "run_trainer.py", *trainer("first"))
        swarm.start("second", "run_trainer.py", *trainer("second"))
        swarm.wait_until(lambda: len(steps_done()) >= 4, timeout=150, what="four global steps")

        swarm.start("late", "run_trainer.py", *trainer("late"))
        joined = swarm.wait_until(
            lambda: re.search(r"Starting at global epoch (\d+)", swarm.read_log("late")),
            timeout=120,
            what="the late trainer to join",
        )
        # it downloaded the state of a recent epoch (a donor may be one epoch behind the newest)
        assert int(joined.group(1)) >= 3, swarm.read_log("late")
        swarm.wait_until(
            lambda: (
                any(row["alive_peers"] == "3" for row in read_rows(metrics_path)) and len(steps_done()) >= 12
            ),
            timeout=90,
            what="12 steps, one of them with all three trainers",
        )
        url = re.search(r"Dashboard: (http://\S+)", swarm.read_log("monitor")).group(1)
        with urllib.request.urlopen(url + "api/state", timeout=10) as response:
            dashboard = json.load(response)
        shown = [point["step"] for point in dashboard["loss"]]
        assert len(shown) >= 12 and set(shown) <= set(steps_done()), (shown, steps_done())
        assert dashboard["swarm"]["trainers"] == 3 and dashboard["run_id"] == "albert", dashboard["swarm"]
        codes = swarm.stop()
    assert codes == {"monitor": 0, "first": 0, "second": 0, "late": 0}, codes
    with pytest.raises(ProcessLookupError):
        os.killpg(swarm.group, 0)  # nothing of the swarm is left

    rows = read_rows(metrics_path)
    steps, losses = [int(row["step"]) for row in rows], [float(row["loss"]) for row in rows]
    assert steps == list(range(1, len(steps) + 1)), "the metrics file has every step, once, in order"
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, losses  # ~0.3-0.4 in 12 steps when measured
    assert "Step #1  loss = " in swarm.read_log("monitor")
    checkpoints = sorted((tmp_path / "checkpoints").iterdir())
    assert (
        checkpoints
        and (checkpoints[-1] / "config.json").exists()
        and (checkpoints[-1] / "optimizer.pt").exists()
    )
    logged = [json.loads(line) for line in open(wandb_log)]
    assert logged[0][0] == "init" and [data["step"] for kind, data in logged if kind == "log"] == steps


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_demo_command_runs_a_short_swarm_and_summarizes_it(tokenized, tmp_path):
    data_dir = tmp_path / "data"
    (data_dir / "demo_corpus").mkdir(parents=True)
    (data_dir / "demo_corpus" / "corpus.txt").write_text("built already\n")
    os.symlink(tokenized, data_dir / "albert_tokenized")  # the demo then skips building its corpus
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "plexus.cli.main",
            "demo",
            "--steps",
            "3",
            "--trainers",
            "1",
            "--client_trainers",
            "1",
            "--target_batch_size",
            "64",
            "--data_dir",
            str(data_dir),
            "--run_dir",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"--initial_peers /ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+", result.stdout)
    assert "global epoch" in result.stdout  # the plain view (no terminal here)
    summary = re.search(
        r"Summary: (\d+) global steps in \d+ s by (\d+) peers; MLM loss ([\d.]+) -> ([\d.]+)", result.stdout
    )
    assert summary and int(summary.group(1)) >= 3 and int(summary.group(2)) == 2, result.stdout
    assert "none is left" in result.stdout
    assert open(tmp_path / "run" / "loss.png", "rb").read(4) == b"\x89PNG"
    assert len(read_rows(str(tmp_path / "run" / "loss.csv"))) == int(summary.group(1))


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text` (a unique temporary path)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_stops_the_demo_and_every_process_it_started(tokenized, tmp_path):
    import signal

    data_dir = tmp_path / "data"
    (data_dir / "demo_corpus").mkdir(parents=True)
    (data_dir / "demo_corpus" / "corpus.txt").write_text("built already\n")
    os.symlink(tokenized, data_dir / "albert_tokenized")
    run_dir = str(tmp_path / "run")
    demo = subprocess.Popen(
        [sys.executable, "-m", "plexus.cli.main", "demo", "--data_dir", str(data_dir), "--run_dir", run_dir],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in demo.stdout:
            if line.startswith("Started"):
                break
        assert len(set(processes_mentioning(run_dir)) - {demo.pid}) == 5  # the monitor and four trainers
        demo.send_signal(signal.SIGINT)
        output, _ = demo.communicate(timeout=90)
    finally:
        demo.kill()
    assert demo.returncode == 130, output
    assert "Interrupted: stopping the swarm" in output and "none is left" in output
    assert processes_mentioning(run_dir) == []


@pytest.mark.timeout(30)
def test_trainer_takes_every_flag_the_tutorial_uses():
    from transformers import HfArgumentParser

    from plexus.examples.albert import run_trainer

    parser = HfArgumentParser(
        (
            run_trainer.AlbertTrainingArguments,
            run_trainer.CollaborationArguments,
            run_trainer.DatasetArguments,
        )
    )
    args, collab, data = parser.parse_args_into_dataclasses(
        args=[
            "--initial_peers",
            "/ip4/1.2.3.4/tcp/1337/p2p/XXXX",
            "/ip4/1.2.3.4/tcp/1338/p2p/YYYY",
            "--per_device_train_batch_size",
            "4",
            "--gradient_accumulation_steps",
            "2",
            "--client_mode",
            "--matchmaking_time",
            "10",
            "--batch_size_lead",
            "300",
            "--dataset_path",
            "./data",
            "--tokenizer",
            "./tok",
            "--host_maddrs",
            "/ip4/0.0.0.0/tcp/31337",
            "--identity_path",
            "./id.key",
            "--logging_dir",
            "./logs",
            "--logging_first_step",
            "--output_dir",
            "./outputs",
            "--overwrite_output_dir",
            "--config",
            "large",
        ]
    )
    assert collab.initial_peers == ["/ip4/1.2.3.4/tcp/1337/p2p/XXXX", "/ip4/1.2.3.4/tcp/1338/p2p/YYYY"]
    assert (collab.client_mode, collab.matchmaking_time, collab.batch_size_lead) == (True, 10.0, 300)
    assert (collab.host_maddrs, collab.identity_path) == (["/ip4/0.0.0.0/tcp/31337"], "./id.key")
    assert (data.dataset_path, data.tokenizer_path, data.config) == ("./data", "./tok", "large")
    assert args.overwrite_output_dir and args.logging_first_step and args.logging_dir == "./logs"
    assert run_trainer.batch_size_per_step(args) == 8
    assert run_trainer.load_config("large", 30000, 512).hidden_size == 1024
    with pytest.raises(UsageError, match="neither tiny, large"):
        run_trainer.load_config("medium", 30000, 512)


@pytest.mark.timeout(120)
def test_a_trainer_resumes_from_its_own_checkpoint_at_its_epoch(tokenized, tmp_path):
    flags = [
        "--dataset_path",
        tokenized,
        "--target_batch_size",
        "16",
        "--per_device_train_batch_size",
        "8",
        "--host_maddrs",
        "/ip4/127.0.0.1/tcp/0",
        "--output_dir",
        str(tmp_path / "out"),
        "--save_steps",
        "3",
        "--logging_dir",
        str(tmp_path / "logs"),
        "--disable_tqdm",
        "true",
        "--report_to",
        "none",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")

    def train(max_steps: int) -> str:
        result = subprocess.run(
            [sys.executable, "run_trainer.py", *flags, "--max_steps", str(max_steps)],
            cwd=EXAMPLE,
            env=env,
            capture_output=True,
            text=True,
            timeout=100,
        )
        assert result.returncode == 0, result.stderr
        return result.stderr

    first = train(6)  # alone: a global epoch every two local steps of 8 samples
    assert "Starting at global epoch 0" in first and sorted(os.listdir(tmp_path / "out")) == [
        "checkpoint-3",
        "checkpoint-6",
    ]
    second = train(10)
    assert f"resuming from {tmp_path / 'out' / 'checkpoint-6'}" in second
    assert "Starting at global epoch 3" in second and "Step #4" in second


@pytest.mark.timeout(10)
def test_monitor_reads_the_swarms_progress_and_skips_stale_or_malformed_reports():
    from plexus.examples.albert.run_training_monitor import swarm_progress
    from plexus.utils.timed_storage import ValueWithExpiration

    def report(epoch, samples, speed, when, client=False):
        return dict(
            epoch=epoch, samples_accumulated=samples, samples_per_second=speed, time=when, client_mode=client
        )

    found = ValueWithExpiration(
        {
            b"a": ValueWithExpiration(report(3, 10, 2.0, 100.0), 0),
            b"b": ValueWithExpiration(report(2, 7, 1.0, 99.0), 0),
            b"c": ValueWithExpiration(
                report(9, 5, 1.0, 100.0, client=True), 0
            ),  # clients do not set the epoch
            b"old": ValueWithExpiration(report(4, 5, 1.0, 10.0), 0),
            b"gone": ValueWithExpiration(None, 0),
            b"bad": ValueWithExpiration({"epoch": "3"}, 0),
        },
        0,
    )
    assert swarm_progress(found, now=101.0) == dict(
        epoch=3, peers=3, clients=1, samples_accumulated=10, samples_per_second=4.0
    )
    assert swarm_progress(None, now=101.0)["peers"] == 0
