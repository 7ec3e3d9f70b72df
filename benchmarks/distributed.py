"""plexus.distributed benchmark: two peers of 2 ranks each (gloo, DDP) against two peers of 1 rank.

Run: `.venv/bin/python benchmarks/distributed.py [--epochs 4] [--target 4096] [--hidden 1024]`

Model: MLP 256-hidden-256 (0.5 M parameters at hidden 1024), SGD, batch 32 per rank of random rows
(mean squared error); every rank uses one torch thread, and every peer is a job of spawned
processes on 127.0.0.1 with `plexus.distributed.DistributedOptimizer(target_batch_size=T,
matchmaking_time=1)`. Both setups run the same number of epochs after one warm-up epoch.

Columns, per epoch (one round of the swarm): seconds; bytes rank 0 received from the swarm (what
its Plexus connections read: DHT, progress, matchmaking, all-reduce, state rounds), also per gradient
round that averaged (an epoch whose round failed steps alone and sends less); bytes its job
broadcast to its other ranks (reports and parameters; DDP's own all-reduce is not counted, it is
the same as in any DDP job). Ratios: 2-rank peers over 1-rank peers, measured in the same run.
A 2-rank peer brings twice the samples per step, so it reaches the target in half the steps;
the swarm's bytes per round should not grow, since the job is one identity in the swarm.
"""

import argparse
import datetime
import functools
import multiprocessing as mp
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCH = 32
FAST_TRACKER = dict(min_refresh_period=0.05, max_refresh_period=1.0, default_refresh_period=0.2)


def count_received_bytes() -> list[int]:
    """Count what this process's Plexus connections receive (before decryption: all its swarm traffic in)."""
    from plexus.p2p.connection import Connection

    received = [0]
    buffer_updated = Connection.buffer_updated

    def counting(self, nbytes: int) -> None:
        received[0] += nbytes
        return buffer_updated(self, nbytes)

    Connection.buffer_updated = counting
    return received


def run_rank(job, rank, world_size, port, args, addresses, results, barrier) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from plexus.dht.dht import DHT
    from plexus.distributed import DistributedOptimizer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    sent, dht = [0], None
    if rank == 0:
        sent = count_received_bytes()
        dht = DHT(
            initial_peers=addresses.get(timeout=120) if job else None,
            start=True,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        )
        if job == 0:
            addresses.put([str(a) for a in dht.get_visible_maddrs()])
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(
            torch.nn.Linear(256, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, 256)
        )
    )
    inputs, targets = torch.randn(4096, 256), torch.randn(4096, 256)
    opt = DistributedOptimizer(
        dht=dht,
        run_id="bench",
        target_batch_size=args.target,
        batch_size_per_step=BATCH,
        optimizer=functools.partial(torch.optim.SGD, lr=0.01),
        params=model.parameters(),
        matchmaking_time=1.0,
        averaging_timeout=30.0,
        tracker_opts=FAST_TRACKER,
        averager_opts=dict(target_group_size=2, min_group_size=2),
        verbose=args.verbose,
    )
    barrier.wait(120)
    start = None
    while opt.local_epoch < 1 + args.epochs:
        epoch = opt.local_epoch
        rows = torch.randint(0, len(inputs), (BATCH,))
        torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows]).backward()
        opt.step()
        opt.zero_grad()
        if opt.local_epoch != epoch and opt.local_epoch == 1:  # the warm-up epoch is over
            start = (time.monotonic(), sent[0], opt.job.bytes_broadcast, rounds_averaged(opt))
    seconds, swarm_bytes, job_bytes, rounds = (
        time.monotonic() - start[0],
        sent[0] - start[1],
        opt.job.bytes_broadcast - start[2],
        rounds_averaged(opt) - start[3],
    )
    opt.shutdown()
    if rank == 0:
        results.put((job, dict(seconds=seconds, swarm=swarm_bytes, job=job_bytes, rounds=rounds)))
        dht.shutdown()
    dist.destroy_process_group()


def rounds_averaged(opt) -> int:
    return opt.optimizer.rounds_averaged if opt.is_leader else 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_setup(world_size: int, args) -> list[dict]:
    context = mp.get_context("spawn")
    addresses, results = context.Queue(), context.Queue()
    barrier = context.Barrier(2 * world_size)
    processes = []
    for job in range(2):
        port = free_port()
        for rank in range(world_size):
            process = context.Process(
                target=run_rank, args=(job, rank, world_size, port, args, addresses, results, barrier)
            )
            process.start()
            processes.append(process)
    outcomes = dict(results.get(timeout=600) for _ in range(2))
    for process in processes:
        process.join(30)
    return [outcomes[0], outcomes[1]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=4, help="epochs measured after one warm-up epoch")
    parser.add_argument("--target", type=int, default=4096, help="target_batch_size")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden width of the MLP")
    parser.add_argument("--verbose", action="store_true", help="rank 0 logs every epoch and round")
    args = parser.parse_args()
    rows = {}
    for world_size in (1, 2):
        outcomes = run_setup(world_size, args)
        rows[world_size] = {
            key: sum(o[key] for o in outcomes) / len(outcomes) / args.epochs
            for key in ("seconds", "swarm", "job")
        }
        rows[world_size]["rounds"] = min(o["rounds"] for o in outcomes)
        rows[world_size]["per_round"] = sum(o["swarm"] for o in outcomes) / max(
            1, sum(o["rounds"] for o in outcomes)
        )
    print(f"{args.epochs} epochs, target {args.target}, hidden {args.hidden}, batch {BATCH} per rank")
    print(
        "| ranks per peer | s/epoch | swarm bytes in/epoch (rank 0) | swarm bytes in/averaged round "
        "| job broadcast bytes/epoch | averaged rounds |"
    )
    print("|---|---|---|---|---|---|")
    for world_size, row in rows.items():
        print(
            f"| {world_size} | {row['seconds']:.2f} | {row['swarm']:,.0f} | {row['per_round']:,.0f} "
            f"| {row['job']:,.0f} | {row['rounds']} of {args.epochs} |"
        )
    one, two = rows[1], rows[2]
    print(
        f"2-rank / 1-rank peers: time per epoch x{two['seconds'] / one['seconds']:.2f}, "
        f"swarm bytes in per averaged round x{two['per_round'] / one['per_round']:.2f}"
    )


if __name__ == "__main__":
    main()
