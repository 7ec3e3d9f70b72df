"""Mixture-of-experts benchmark: remote experts on a Plexus server against the same modules in-process.

Run: `.venv/bin/python benchmarks/moe.py [--experts 16] [--hidden 1024] [--clients 4] [--batch 64]
[--seconds 20] [--warmup 3] [--threads N]`

`--threads N` sets OMP_NUM_THREADS (torch's intra-op threads) for the baseline and the server's
compute thread alike. On a small machine shared with other work, torch's default (one thread per
core) makes every op wait for all its threads to get a core: measured here, 1 thread ran a step in
10 ms, 2 threads in 250 ms. The baseline runs on a thread of its own, as the server's compute does.

1. In-process baseline: `--experts` ffn experts (hidden `--hidden`, Adam) in this process. Each
   step picks a random expert, runs forward and backward on `--batch` random rows with random
   output gradients and takes an optimizer step: the work a server does per forward+backward pair,
   minus its recomputation of the forward during backward.
2. Server start-up: `Server.create(num_experts, expert_pattern="ffn.[0:E]", hidden_dim, ...)` with
   a DHT of its own, timed whole; its networking part (starting a DHT and announcing every
   expert) is timed again on its own.
3. Remote: `--clients` spawned processes join the server's DHT (client mode), get all experts with
   `get_experts`, and loop: random expert, `RemoteExpert` forward, backward with random output
   gradients. Calls finishing inside the measured window (after `--warmup` s) count.

Columns: samples/s (rows through forward+backward per second, all clients together), latency of
one forward+backward pair (p50/p99), and the ratio to the in-process samples/s of the same run.
"""

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

torch = None  # imported in main, after --threads is applied

LOCAL = ["/ip4/127.0.0.1/tcp/0"]


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")


def in_process(args) -> dict:
    """Run `_in_process` on a fresh thread, the way the server runs its experts."""
    result = {}
    worker = threading.Thread(target=lambda: result.update(_in_process(args)))
    worker.start()
    worker.join()
    return result


def _in_process(args) -> dict:
    from plexus.moe.server.layers import name_to_block

    experts = [name_to_block["ffn"](args.hidden) for _ in range(args.experts)]
    optimizers = [torch.optim.Adam(e.parameters()) for e in experts]
    rng = random.Random(0)
    latencies, samples = [], 0
    started = time.perf_counter()
    window = started + args.warmup
    while (now := time.perf_counter()) < window + args.seconds:
        i = rng.randrange(args.experts)
        x = torch.randn(args.batch, args.hidden, requires_grad=True)
        experts[i](x).backward(torch.randn(args.batch, args.hidden))
        optimizers[i].step()
        optimizers[i].zero_grad(set_to_none=True)
        done = time.perf_counter()
        if now >= window:
            latencies.append(done - now)
            samples += args.batch
    return dict(samples_per_s=samples / (time.perf_counter() - window), latencies=latencies)


def client(index, maddrs, uids, args, start_at, results) -> None:
    global torch
    import torch
    torch.set_num_threads(1)
    from plexus.dht.dht import DHT
    from plexus.moe import get_experts

    dht = DHT(initial_peers=maddrs, start=True, client_mode=True)
    experts = get_experts(dht, uids)
    for expert in experts:
        expert.schema  # fetched once, before the clock starts
    rng = random.Random(index)
    calls = []
    while time.time() < start_at:
        time.sleep(0.01)
    window, end = start_at + args.warmup, start_at + args.warmup + args.seconds
    while (began := time.time()) < end:
        expert = experts[rng.randrange(len(experts))]
        x = torch.randn(args.batch, args.hidden, requires_grad=True)
        expert(x).backward(torch.randn(args.batch, args.hidden))
        finished = time.time()
        if began >= window and finished <= end:
            calls.append(finished - began)
    results.put((index, calls))
    dht.shutdown()


def remote(args) -> dict:
    from plexus.dht.dht import DHT
    from plexus.moe import Server, declare_experts
    from plexus.utils.timing import get_dht_time

    started = time.perf_counter()
    server = Server.create(num_experts=args.experts, expert_pattern=f"ffn.[0:{args.experts}]",
                           hidden_dim=args.hidden, device="cpu", start=True, host_maddrs=LOCAL)
    startup = time.perf_counter() - started
    # the networking part, measured again on its own: a DHT and one announcement of every expert
    began = time.perf_counter()
    probe = DHT(start=True, host_maddrs=LOCAL)
    declare_experts(probe, list(server.module_backends), get_dht_time() + 60)
    networking = time.perf_counter() - began
    probe.shutdown()
    try:
        context = mp.get_context("spawn")
        results = context.Queue()
        start_at = time.time() + 15 + 2 * args.clients  # spawned processes import torch first
        processes = [context.Process(target=client, args=(i, [str(a) for a in server.dht.get_visible_maddrs()],
                                                          list(server.module_backends), args, start_at, results))
                     for i in range(args.clients)]
        for process in processes:
            process.start()
        calls = []
        for _ in processes:
            _, latencies = results.get(timeout=start_at - time.time() + args.warmup + args.seconds + 60)
            calls += latencies
        for process in processes:
            process.join(30)
    finally:
        server.shutdown()
    return dict(samples_per_s=len(calls) * args.batch / args.seconds, latencies=calls, startup=startup,
                networking=networking)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's, one per core)")
    args = parser.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    global torch
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{os.cpu_count()} CPUs, torch {torch.__version__} with {torch.get_num_threads()} threads; "
          f"{args.experts} ffn experts, hidden {args.hidden}, batch {args.batch}, {args.clients} client processes, "
          f"{args.seconds:.0f} s measured after {args.warmup:.0f} s warm-up", flush=True)
    local = in_process(args)
    far = remote(args)
    print()
    print("| path | samples/s | fwd+bwd p50 ms | fwd+bwd p99 ms | vs in-process |")
    print("|---|---|---|---|---|")
    for name, row in (("in-process (same modules, Adam)", local), (f"remote, {args.clients} client processes", far)):
        print(f"| {name} | {row['samples_per_s']:.0f} | {1000 * statistics.median(row['latencies']):.1f} | "
              f"{1000 * percentile(row['latencies'], 99):.1f} | {row['samples_per_s'] / local['samples_per_s']:.2f}x |")
    print(f"\nserver start-up: {far['startup']:.2f} s in all, {far['networking']:.3f} s of it networking "
          f"(a DHT and announcing {args.experts} experts); hivemind's published figure: 11 s, 7.9 s networking")


if __name__ == "__main__":
    main()
