"""Time and bytes to a target loss: synchronous `plexus.Optimizer` vs DiLoCo vs Streaming DiLoCo.

Run: `.venv/bin/python benchmarks/diloco.py [--peers 4] [--steps 200] [--target-loss 0.115]`

Task: MLP 16-256-256-1 (~70k parameters) fitting sin(x @ w) plus noise of variance 0.09 (so no
model gets below ~0.09), batches of 16 per peer; every peer is a thread of this process with its
own DHT on 127.0.0.1, all training at once for `--steps` batches each. Every 5 batches peer 0's
model is evaluated on 4096 held-out samples; the first time its loss is at most `--target-loss`
the wall-clock time since the start of training and the bytes each host has sent so far (mean
over peers, `Host.traffic`: everything on the wire, the DHT included) are recorded. (DiLoCo's
peer 0 is evaluated on its local model, which between rounds is one worker's, not the swarm's.)

Runs, each measured in this process, one after another:
- sync: `plexus.Optimizer(target_batch_size=peers*16, AdamW(lr=1e-3))`, one global step per batch;
- diloco: `DiLoCoOptimizer`, AdamW(lr=1e-3) inner, H=20, outer SGD Nesterov (0.7, 0.9), float32;
- diloco-int8, diloco-int4: the same with quantized pseudo-gradients (error feedback);
- streaming: 4 fragments staggered by 5 steps, rounds overlapped with inner steps.
Columns: time and bytes to the target, and their ratios to the synchronous baseline (> 1: fewer).
Loopback has no latency or bandwidth limit, so wall-clock ratios understate what a WAN shows.
"""

import argparse
import functools
import logging
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from plexus import DHT, DiLoCoOptimizer, DiLoCoOptions, Optimizer

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
BATCH = 16


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(256, 1))


WEIGHTS = torch.randn(16, 1, generator=torch.Generator().manual_seed(7)) / 4


def batches(peer: int, batch: int = BATCH):
    generator = torch.Generator().manual_seed(200 + peer)
    while True:
        inputs = torch.randn(batch, 16, generator=generator)
        yield inputs, torch.sin(inputs @ WEIGHTS) + 0.3 * torch.randn(batch, 1, generator=generator)


HELD_OUT = next(batches(99, 4096))


def held_out_loss(model) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(HELD_OUT[0]), HELD_OUT[1]))


def make_swarm(n: int) -> list[DHT]:
    first = DHT(start=True, host_maddrs=LOCAL)
    return [first] + [
        DHT(initial_peers=first.get_visible_maddrs(), start=True, host_maddrs=LOCAL) for _ in range(n - 1)
    ]


def build(kind: str, dht: DHT, model, peers: int):
    adam = functools.partial(torch.optim.AdamW, lr=1e-3)
    if kind == "sync":
        return Optimizer(
            dht=dht,
            run_id=kind,
            target_batch_size=peers * BATCH,
            batch_size_per_step=BATCH,
            optimizer=adam,
            params=model.parameters(),
            matchmaking_time=1.0,
            averaging_timeout=30.0,
            average_state_every=10**6,  # gradients only: the fair synchronous baseline
            averager_opts=dict(target_group_size=peers, request_timeout=1.0),
        )
    compression = {"diloco-int8": "int8", "diloco-int4": "int4"}.get(kind, "none")
    options = DiLoCoOptions(
        inner_steps=20,
        batch_size_per_step=BATCH,
        compression=compression,
        fragments=4 if kind == "streaming" else 1,
        matchmaking_time=2.0,
        averager_opts=dict(target_group_size=peers, min_group_size=peers, request_timeout=1.0),
        tracker_opts=dict(min_refresh_period=0.2, max_refresh_period=2.0),
    )
    return DiLoCoOptimizer(
        dht=dht, run_id=kind, params=model.parameters(), inner_optimizer=adam, options=options
    )


def run(kind: str, peers: int, steps: int, target_loss: float) -> dict:
    dhts = make_swarm(peers)
    models = [make_model() for _ in range(peers)]
    optimizers = [build(kind, dht, model, peers) for dht, model in zip(dhts, models)]
    reached: dict = {}
    start = time.monotonic()
    before = [dht.host.traffic.bytes_sent for dht in dhts]

    def sent_so_far() -> float:
        return sum(dht.host.traffic.bytes_sent - b for dht, b in zip(dhts, before)) / peers

    def train(i: int) -> None:
        stream = batches(i)
        for step in range(steps):
            inputs, targets = next(stream)
            torch.nn.functional.mse_loss(models[i](inputs), targets).backward()
            optimizers[i].step()
            optimizers[i].zero_grad()
            if i == 0 and step % 5 == 4 and not reached and held_out_loss(models[0]) <= target_loss:
                reached.update(seconds=time.monotonic() - start, bytes=sent_so_far(), step=step + 1)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(peers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    outcome = dict(kind=kind, final_loss=held_out_loss(models[0]), total_bytes=sent_so_far(), **reached)
    outcome["total_seconds"] = time.monotonic() - start
    for optimizer in optimizers:
        optimizer.shutdown()
    for dht in dhts:
        dht.shutdown()
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--target-loss", type=float, default=0.115)
    parser.add_argument(
        "--runs", nargs="+", default=["sync", "diloco", "diloco-int8", "diloco-int4", "streaming"]
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("plexus").setLevel(logging.ERROR)
    results = [run(kind, args.peers, args.steps, args.target_loss) for kind in args.runs]
    baseline = next((r for r in results if r["kind"] == "sync"), results[0])
    print(
        f"{args.peers} peers, {args.steps} batches of {BATCH} each, target held-out loss {args.target_loss}"
    )
    header = ("run", "final loss", "s total", "s to target", "kB to target", "time x", "bytes x")
    print("{:<12} {:>10} {:>8} {:>12} {:>13} {:>7} {:>8}".format(*header))
    for r in results:
        if "seconds" in r and "seconds" in baseline:
            time_ratio = f"{baseline['seconds'] / r['seconds']:.1f}"
            bytes_ratio = f"{baseline['bytes'] / r['bytes']:.0f}"
            to_target = f"{r['seconds']:>12.1f} {r['bytes'] / 1e3:>13.0f}"
        else:
            time_ratio = bytes_ratio = "-"
            to_target = f"{'not reached':>12} {r['total_bytes'] / 1e3:>13.0f}"
        print(
            f"{r['kind']:<12} {r['final_loss']:>10.4f} {r['total_seconds']:>8.1f} {to_target} "
            f"{time_ratio:>7} {bytes_ratio:>8}"
        )


if __name__ == "__main__":
    main()
