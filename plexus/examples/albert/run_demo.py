#!/usr/bin/env python3
"""One command, a whole swarm on this machine: a monitor and four trainers pre-train a tiny ALBERT.

    make demo                                  # from the repository root: sets up .venv, then this
    plexus demo --steps 40                     # the same, as a command
    python run_demo.py --steps 10 --trainers 2 --client_trainers 0     # in examples/albert

What happens: the demo corpus and tokenizer are built once (data/, ~1 minute, cached). Then a
training monitor starts on 127.0.0.1 and prints the --initial_peers line; three trainers and one
client-mode trainer (like a peer behind NAT: it dials out, accepts nothing) join it, each on one
CPU thread. Together they accumulate --target_batch_size samples per global step, average their
gradients and step. The terminal shows the peers, the global epoch, the loss and the samples/s.
After --steps global steps (or Ctrl+C) every process is stopped, and a summary follows: the loss
curve as PNG and CSV in --run_dir, how many peers took part, and the swarm's samples/s.

Another machine can join while it runs: the monitor listens on 127.0.0.1 only, so start the demo
with --host 0.0.0.0 and give that machine the printed address with this machine's IP.
"""

import csv
import json
import os
import shutil
import subprocess
import sys
import time

# -- the swarm --
steps = 30  # stop after this many global steps (the loss flattens near 6.8 by then)
trainers = 3  # trainers that accept connections
client_trainers = 1  # trainers in client mode
host = "127.0.0.1"  # interface to listen on (0.0.0.0 lets other machines join)
# -- training (see run_trainer.py) --
target_batch_size = 256  # samples per global step, over the whole swarm
per_device_train_batch_size = 32  # samples per micro-batch on each trainer
learning_rate = 0.05  # LAMB's peak, reached after warmup_steps global steps
warmup_steps = 10  # global steps of linear warm-up
matchmaking_time = 2.0  # seconds to gather the group for averaging
# -- files --
data_dir = "data"  # the corpus and tokenized data, built here if missing (relative to the current folder)
run_dir = (
    "data/demo_run"  # logs, metrics, loss.png and loss.csv; emptied at start (relative to the current folder)
)
timeout = 1200.0  # give up if the swarm has not finished by then (seconds)
refresh = 1.0  # seconds between updates of the view


def prepare_data(data_path: str) -> str:
    """Build the demo corpus and tokenize it, unless already done; returns the tokenized folder."""
    corpus, tokenized = os.path.join(data_path, "demo_corpus"), os.path.join(data_path, "albert_tokenized")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if not os.path.exists(os.path.join(corpus, "corpus.txt")):
        print(f"Building the demo corpus in {corpus} (once, ~30 s)...", flush=True)
        subprocess.run(
            [sys.executable, "-m", f"{__package__}.make_demo_corpus", "--output_dir", corpus],
            env=env,
            check=True,
        )
    if not os.path.exists(os.path.join(tokenized, "meta.json")):
        print(f"Training a tokenizer and tokenizing into {tokenized} (once, ~30 s)...", flush=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                f"{__package__}.tokenize_corpus",
                "--input_path",
                corpus,
                "--output_dir",
                tokenized,
            ],
            env=env,
            check=True,
        )
    return tokenized


def trainer_args(name: str, peers: list[str], dataset: str, client: bool) -> list[str]:
    folder = os.path.join(run_dir, name)
    return [
        "--initial_peers",
        *peers,
        "--dataset_path",
        dataset,
        "--config",
        "tiny",
        "--target_batch_size",
        str(target_batch_size),
        "--per_device_train_batch_size",
        str(per_device_train_batch_size),
        "--learning_rate",
        str(learning_rate),
        "--warmup_steps",
        str(warmup_steps),
        "--matchmaking_time",
        str(matchmaking_time),
        "--averaging_timeout",
        "30",
        "--output_dir",
        folder,
        "--logging_dir",
        os.path.join(folder, "logs"),
        "--overwrite_output_dir",
        "--save_steps",
        str(10**9),
        "--logging_steps",
        "50",
        "--disable_tqdm",
        "true",
        "--report_to",
        "none",
        *(["--client_mode"] if client else ["--host_maddrs", f"/ip4/{host}/tcp/0"]),
    ]


class View:
    """The live view: a table redrawn in place on a terminal, a plain line every few seconds otherwise."""

    def __init__(self, stream=sys.stdout):
        self.stream, self.tty = stream, stream.isatty()
        self.drawn_lines, self.last_plain = 0, 0.0

    def show(self, status: dict | None, names: dict[str, str], elapsed: float, losses: list[float]) -> None:
        if status is None:
            status = dict(
                progress=dict(epoch=0, peers=0, clients=0, samples_accumulated=0, samples_per_second=0.0),
                trainers=[],
            )
        progress, last = status["progress"], status.get("last_step") or {}
        loss = f"{last['loss']:.3f}" if last else "-"
        if not self.tty:
            if time.monotonic() - self.last_plain >= 5:
                self.last_plain = time.monotonic()
                print(
                    f"[{elapsed:5.0f} s] global epoch {progress['epoch']}/{steps}  loss {loss}  "
                    f"peers {progress['peers']}  {progress['samples_per_second']:.0f} samples/s",
                    flush=True,
                )
            return
        lines = [
            f"\033[1mglobal epoch {progress['epoch']}/{steps}\033[0m   next step: {progress['samples_accumulated']}"
            f"/{target_batch_size} samples   elapsed {elapsed:.0f} s",
            f"swarm: {progress['peers']} peers ({progress['clients']} in client mode), "
            f"{progress['samples_per_second']:.1f} samples/s",
            f"MLM loss: {loss}   {sparkline(losses)}",
            f"{'peer':<18} {'name':<10} {'mode':<7} {'step':>5} {'loss':>7} {'samples/s':>10}",
        ]
        for row in status["trainers"]:
            lines.append(
                f"{row['peer_id'][:6] + '…' + row['peer_id'][-6:]:<18} {names.get(row['peer_id'], '?'):<10} "
                f"{'client' if row['client_mode'] else 'full':<7} {row['step']:>5} {row['loss']:>7.3f} "
                f"{row['samples_per_second']:>10.1f}"
            )
        if self.drawn_lines:
            self.stream.write(f"\033[{self.drawn_lines}F")  # back to the first line of the last frame
        self.stream.write("".join(f"\033[2K{line}\n" for line in lines) + "\033[J")
        self.stream.flush()
        self.drawn_lines = len(lines)


def sparkline(values: list[float], width: int = 40) -> str:
    if len(values) < 2:
        return ""
    values = values[-width:]
    low, high = min(values), max(values)
    bars = "▁▂▃▄▅▆▇█"
    return "".join(bars[int((v - low) / (high - low + 1e-12) * (len(bars) - 1))] for v in values)


def read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def read_rows(path: str) -> list[dict]:
    try:
        with open(path, newline="") as f:
            return [
                dict(
                    step=int(r["step"]),
                    loss=float(r["loss"]),
                    alive_peers=int(r["alive_peers"]),
                    samples=int(r["samples"]),
                    samples_per_second=float(r["samples_per_second"]),
                    time=float(r["time"]),
                )
                for r in csv.DictReader(f)
            ]
    except FileNotFoundError:
        return []


def summarize(rows: list[dict], peers_seen: int, duration: float) -> dict:
    """Write loss.csv and loss.png; return the numbers the summary prints."""
    from .plot import write_line_plot

    with open(os.path.join(run_dir, "loss.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "loss"])
        writer.writerows((row["step"], f"{row['loss']:.5f}") for row in rows)
    if rows:
        write_line_plot(
            os.path.join(run_dir, "loss.png"),
            [r["step"] for r in rows],
            [r["loss"] for r in rows],
            title="MLM loss",
            x_label="global step",
        )
    training_time = rows[-1]["time"] - rows[0]["time"] if len(rows) > 1 else 0.0
    return dict(
        steps=len(rows),
        duration=duration,
        peers=peers_seen,
        first_loss=rows[0]["loss"] if rows else None,
        last_loss=rows[-1]["loss"] if rows else None,
        samples=sum(r["samples"] for r in rows),
        samples_per_second=sum(r["samples"] for r in rows[1:]) / training_time if training_time else 0.0,
    )


def main(argv: list[str] | None = None) -> int:
    from .flags import apply_flags

    apply_flags(globals(), __doc__, argv)
    from .swarm import LocalSwarm, SwarmError

    global run_dir
    run_dir = os.path.abspath(run_dir)
    dataset = prepare_data(os.path.abspath(data_dir))
    shutil.rmtree(run_dir, ignore_errors=True)
    started = time.monotonic()
    status_path, metrics_path = os.path.join(run_dir, "status.json"), os.path.join(run_dir, "metrics.csv")
    swarm, interrupted, failure = LocalSwarm(run_dir), False, None
    try:
        peers = swarm.start_monitor(
            "--host_maddrs",
            f"/ip4/{host}/tcp/0",
            "--refresh_period",
            str(refresh),
            "--settle_time",
            "3",
            "--metrics_path",
            metrics_path,
            "--status_path",
            status_path,
        )
        print(
            f"The monitor is up. To join this swarm from elsewhere, run run_trainer.py with\n"
            f"  --initial_peers {' '.join(peers)}\n",
            flush=True,
        )
        names = [f"trainer-{i + 1}" for i in range(trainers)] + [
            f"client-{i + 1}" for i in range(client_trainers)
        ]
        for name in names:
            swarm.start(
                name, "run_trainer.py", *trainer_args(name, peers, dataset, name.startswith("client"))
            )
        print(f"Started {len(names)} trainers ({', '.join(names)}); logs in {swarm.log_dir}", flush=True)
        view = View()
        while True:
            status = read_json(status_path)
            losses = [row["loss"] for row in read_rows(metrics_path)]
            view.show(status, swarm.peer_ids(), time.monotonic() - started, losses)
            if status and (status.get("last_step") or {}).get("step", 0) >= steps:
                break
            swarm.check_alive("monitor")
            if time.monotonic() - started > timeout:
                raise SwarmError(
                    f"the swarm did not reach {steps} global steps within {timeout:.0f} s; "
                    f"see the logs in {swarm.log_dir}"
                )
            time.sleep(refresh)
    except KeyboardInterrupt:
        interrupted = True
        print("\nInterrupted: stopping the swarm...", flush=True)
    except SwarmError as error:
        failure = error
    finally:
        codes = swarm.stop()
    status = read_json(status_path) or {}
    result = summarize(read_rows(metrics_path), status.get("peers_seen", 0), time.monotonic() - started)
    print(
        f"\nStopped {len(codes)} processes ({', '.join(f'{n}: {c}' for n, c in codes.items())}); none is left."
    )
    if result["steps"]:
        print(
            f"Summary: {result['steps']} global steps in {result['duration']:.0f} s by {result['peers']} peers; "
            f"MLM loss {result['first_loss']:.3f} -> {result['last_loss']:.3f}; "
            f"{result['samples']} samples, {result['samples_per_second']:.1f} samples/s."
        )
        print(f"Loss curve: {os.path.join(run_dir, 'loss.png')} and {os.path.join(run_dir, 'loss.csv')}")
    else:
        print("No global step was completed.")
    if failure is not None:
        print(f"error: {failure}", file=sys.stderr)
        return 1
    return 130 if interrupted else 0


if __name__ == "__main__":
    from plexus.cli.errors import exit_with

    exit_with(main)
