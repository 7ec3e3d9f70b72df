"""plexus.Optimizer benchmark: 2 peers training together against 2 plain local torch loops.

Run: `.venv/bin/python benchmarks/optimizer.py [--seconds 60] [--targets 32768 256]`

Model: MLP 64-256-10, Adam(lr=1e-3), batch 32 of random rows with random labels (cross-entropy);
every process uses one torch thread.

1. Baseline: two plain local loops (forward, backward, `Adam.step`, `zero_grad`) at once, in two
   spawned processes, for `--seconds`; run again before each swarm so both see similar load.
2. Swarm, for each `--targets` value: two spawned peer processes (one DHT each on 127.0.0.1) wrap
   the same loop in `plexus.Optimizer(target_batch_size=T, batch_size_per_step=32,
   matchmaking_time=3, averaging_timeout=10)`; after both are constructed they train for
   `--seconds`.

Columns: samples/s per peer and for both together (and the ratio to the two local loops),
seconds per epoch (epochs the swarm completed in the window), successful gradient averages with 2
peers per epoch, and the time from the start to the first 2-peer gradient average.
"""

import argparse
import functools
import logging
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCH = 32


def make_model_and_data():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    inputs = torch.randn(4096, 64)
    labels = torch.randint(0, 10, (4096,))
    return model, inputs, labels


def train(model, opt, inputs, labels, seconds: float) -> int:
    """Steps of one random batch each until `seconds` have passed; returns how many."""
    import torch

    steps, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        rows = torch.randint(0, len(inputs), (BATCH,))
        torch.nn.functional.cross_entropy(model(inputs[rows]), labels[rows]).backward()
        opt.step()
        opt.zero_grad()
        steps += 1
    return steps


def local_loop(seconds: float, barrier, results) -> None:
    import torch

    torch.set_num_threads(1)
    model, inputs, labels = make_model_and_data()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    barrier.wait()
    results.put(train(model, opt, inputs, labels, seconds) * BATCH / seconds)


class _Rounds(logging.Handler):
    """Records when the optimizer says it averaged gradients (and with how many peers)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.averages: list[tuple[float, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Averaged gradients with "):
            self.averages.append((time.monotonic(), int(message.split()[3])))


def swarm_peer(index: int, target: int, seconds: float, addresses, barrier, results) -> None:
    import torch

    from plexus.dht.dht import DHT
    from plexus.optim.optimizer import Optimizer

    torch.set_num_threads(1)
    rounds = _Rounds()
    optimizer_logger = logging.getLogger("plexus.optim.optimizer")
    optimizer_logger.setLevel(logging.DEBUG)
    optimizer_logger.addHandler(rounds)
    initial = None if index == 0 else addresses.get()
    dht = DHT(initial_peers=initial, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    if index == 0:
        addresses.put([str(a) for a in dht.get_visible_maddrs()])
    model, inputs, labels = make_model_and_data()
    opt = Optimizer(
        dht=dht,
        run_id=f"bench{target}",
        target_batch_size=target,
        batch_size_per_step=BATCH,
        optimizer=functools.partial(torch.optim.Adam, lr=1e-3),
        params=model.parameters(),
        matchmaking_time=3.0,
        averaging_timeout=10.0,
    )
    barrier.wait()
    start, first_epoch = time.monotonic(), opt.local_epoch
    steps = train(model, opt, inputs, labels, seconds)
    elapsed = time.monotonic() - start
    epochs = opt.local_epoch - first_epoch
    opt.shutdown()
    dht.shutdown()
    pairs = [t for t, n in rounds.averages if n >= 2]
    results.put(
        dict(
            index=index,
            samples_per_s=steps * BATCH / elapsed,
            epochs=epochs,
            seconds=elapsed,
            averages=len(pairs),
            first_average=(pairs[0] - start) if pairs else None,
            state_loads=opt.state_loads,
        )
    )


def run_baseline(seconds: float) -> float:
    context = mp.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    processes = [context.Process(target=local_loop, args=(seconds, barrier, results)) for _ in range(2)]
    for process in processes:
        process.start()
    combined = sum(results.get(timeout=seconds + 120) for _ in processes)
    for process in processes:
        process.join()
    return combined


def run_swarm(target: int, seconds: float) -> list[dict]:
    context = mp.get_context("spawn")
    addresses, barrier, results = context.Queue(), context.Barrier(2), context.Queue()
    processes = [
        context.Process(target=swarm_peer, args=(i, target, seconds, addresses, barrier, results))
        for i in range(2)
    ]
    for process in processes:
        process.start()
    outcomes = sorted((results.get(timeout=seconds + 180) for _ in processes), key=lambda o: o["index"])
    for process in processes:
        process.join(30)
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--targets", type=int, nargs="+", default=[32768, 256])
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.seconds:.0f} s windows\n")
    print(
        "| target | local loops (2) samples/s | peer 0 samples/s | peer 1 samples/s | swarm samples/s "
        "| swarm / local | s per epoch | 2-peer grad averages / epoch | first 2-peer average (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for target in args.targets:
        baseline = run_baseline(args.seconds)
        peers = run_swarm(target, args.seconds)
        combined = sum(p["samples_per_s"] for p in peers)
        epochs = max(p["epochs"] for p in peers)
        per_epoch = f"{peers[0]['seconds'] / epochs:.2f}" if epochs else "-"
        averages = min(p["averages"] for p in peers)
        share = f"{averages}/{epochs} ({averages / epochs:.0%})" if epochs else "-"
        firsts = [p["first_average"] for p in peers if p["first_average"] is not None]
        first = f"{min(firsts):.2f}" if firsts else "never"
        print(
            f"| {target} | {baseline:.0f} | {peers[0]['samples_per_s']:.0f} | {peers[1]['samples_per_s']:.0f} "
            f"| {combined:.0f} | {combined / baseline:.2f}x | {per_epoch} | {share} | {first} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
