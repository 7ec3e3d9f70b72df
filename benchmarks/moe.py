"""Mixture-of-experts benchmark: remote experts on a Plexus server against the same modules in-process.

Run: `.venv/bin/python benchmarks/moe.py [--experts 16] [--hidden 1024] [--clients 4] [--batch 64]
[--seconds 20] [--rounds 4] [--warmup 3] [--threads N]`

`--threads N` sets OMP_NUM_THREADS (torch's intra-op threads) for the baseline and the server's
compute thread alike. On a small machine shared with other work, torch's default (one thread per
core) makes every op wait for all its threads to get a core: measured here, 1 thread ran a step in
10 ms, 2 threads in 250 ms.

1. Server start-up: `Server.create(num_experts, expert_pattern="ffn.[0:E]", hidden_dim, ...)` with
   a DHT of its own, timed whole; its networking part (starting a DHT and announcing every
   expert) is timed again on its own.
2. In-process baseline: the same kind of experts (hidden `--hidden`, Adam) in this process, on a
   thread of their own as the server's are. Each step picks a random expert, runs forward and
   backward on `--batch` random rows with random output gradients and takes an optimizer step: the
   work a server does per forward+backward pair, minus its recomputation of the forward in backward.
3. Remote: `--clients` spawned processes join the server's DHT (client mode), get all experts with
   `get_experts`, and loop: random expert, `RemoteExpert` forward, then backward with random
   output gradients.

The two paths take turns: `--rounds` windows each, of `--seconds / --rounds` seconds, the clients
idle while the baseline runs. The machines here are shared and their load swings by 2x within a
minute; alternating keeps both paths under the same load. A remote call counts when it starts and
ends inside a remote window.

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


class InProcess:
    """The baseline: the same experts and optimizers, stepped on a thread of their own (the way the
    server runs its experts, so both see the same torch thread settings)."""

    def __init__(self, args):
        from plexus.moe.server.layers import name_to_block

        self.args = args
        self.experts = [name_to_block["ffn"](args.hidden) for _ in range(args.experts)]
        self.optimizers = [torch.optim.Adam(e.parameters()) for e in self.experts]
        self.rng = random.Random(0)

    def measure(self, seconds: float) -> tuple[int, list[float]]:
        """(samples, step latencies) over `seconds` of steps."""
        result = []
        worker = threading.Thread(target=lambda: result.append(self._steps(seconds)))
        worker.start()
        worker.join()
        return result[0]

    def _steps(self, seconds: float) -> tuple[int, list[float]]:
        args, latencies = self.args, []
        end = time.perf_counter() + seconds
        while (began := time.perf_counter()) < end:
            i = self.rng.randrange(args.experts)
            x = torch.randn(args.batch, args.hidden, requires_grad=True)
            self.experts[i](x).backward(torch.randn(args.batch, args.hidden))
            self.optimizers[i].step()
            self.optimizers[i].zero_grad(set_to_none=True)
            latencies.append(time.perf_counter() - began)
        return len(latencies) * args.batch, latencies


def client(index, maddrs, uids, args, go, stop, ready, results) -> None:
    """Calls random experts while `go` is set; reports every call as (start, end) wall times."""
    global torch
    import torch

    torch.set_num_threads(1)
    from plexus.dht.dht import DHT
    from plexus.moe import get_experts

    dht = DHT(initial_peers=maddrs, start=True, client_mode=True)
    experts = get_experts(dht, uids)
    for expert in experts:
        _ = expert.schema  # fetched once, before any clock starts
    rng = random.Random(index)
    calls = []
    ready.release()
    while not stop.is_set():
        if not go.wait(0.1):
            continue
        expert = experts[rng.randrange(len(experts))]
        x = torch.randn(args.batch, args.hidden, requires_grad=True)
        began = time.time()
        expert(x).backward(torch.randn(args.batch, args.hidden))
        calls.append((began, time.time()))
    results.put(calls)
    dht.shutdown()


def measure(args) -> dict:
    """Alternate windows of the in-process baseline and of the remote path, `--rounds` times."""
    from plexus.dht.dht import DHT
    from plexus.moe import Server, declare_experts
    from plexus.utils.timing import get_dht_time

    baseline = InProcess(args)
    started = time.perf_counter()
    server = Server.create(
        num_experts=args.experts,
        expert_pattern=f"ffn.[0:{args.experts}]",
        hidden_dim=args.hidden,
        device="cpu",
        start=True,
        host_maddrs=LOCAL,
    )
    startup = time.perf_counter() - started
    # the networking part, measured again on its own: a DHT and one announcement of every expert
    began = time.perf_counter()
    probe = DHT(start=True, host_maddrs=LOCAL)
    declare_experts(probe, list(server.module_backends), get_dht_time() + 60)
    networking = time.perf_counter() - began
    probe.shutdown()

    context = mp.get_context("spawn")
    go, stop, ready, results = context.Event(), context.Event(), context.Semaphore(0), context.Queue()
    maddrs = [str(a) for a in server.dht.get_visible_maddrs()]
    processes = [
        context.Process(
            target=client, args=(i, maddrs, list(server.module_backends), args, go, stop, ready, results)
        )
        for i in range(args.clients)
    ]
    try:
        for process in processes:
            process.start()
        for _ in processes:
            if not ready.acquire(timeout=120):
                raise TimeoutError("a client process did not start within 120 s")
        baseline.measure(args.warmup)
        go.set()
        time.sleep(args.warmup)  # warm-up of the remote path: not measured
        go.clear()
        window = args.seconds / args.rounds
        local_samples, local_latencies, remote_windows, rounds = 0, [], [], []
        for _ in range(args.rounds):
            samples, latencies = baseline.measure(window)
            local_samples += samples
            local_latencies += latencies
            time.sleep(0.5)  # let calls of the previous remote window drain (they are not counted)
            go.set()
            opened = time.time()
            time.sleep(window)
            go.clear()
            remote_windows.append((opened, time.time()))
            rounds.append(samples / window)
        stop.set()
        calls = [call for _ in processes for call in results.get(timeout=60)]
        for process in processes:
            process.join(30)
    finally:
        stop.set()
        go.clear()
        server.shutdown()
        for process in processes:
            if process.is_alive():
                process.kill()
    per_window = [
        [end - begin for begin, end in calls if opened <= begin and end <= closed]
        for opened, closed in remote_windows
    ]
    remote_rates = [len(latencies) * args.batch / window for latencies in per_window]
    return dict(
        local=dict(samples_per_s=local_samples / args.seconds, latencies=local_latencies),
        remote=dict(
            samples_per_s=sum(remote_rates) / len(remote_rates),
            latencies=[x for latencies in per_window for x in latencies],
        ),
        ratios=[r / l for r, l in zip(remote_rates, rounds)],
        startup=startup,
        networking=networking,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=4, help="alternating windows of each path")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's, one per core)")
    args = parser.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    global torch
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"{os.cpu_count()} CPUs, torch {torch.__version__} with {torch.get_num_threads()} threads; "
        f"{args.experts} ffn experts, hidden {args.hidden}, batch {args.batch}, {args.clients} client processes, "
        f"{args.seconds:.0f} s measured per path in {args.rounds} alternating rounds after {args.warmup:.0f} s "
        f"warm-up",
        flush=True,
    )
    result = measure(args)
    local, far = result["local"], result["remote"]
    print()
    print("| path | samples/s | fwd+bwd p50 ms | fwd+bwd p99 ms | vs in-process |")
    print("|---|---|---|---|---|")
    for name, row in (
        ("in-process (same modules, Adam)", local),
        (f"remote, {args.clients} client processes", far),
    ):
        print(
            f"| {name} | {row['samples_per_s']:.0f} | {1000 * statistics.median(row['latencies']):.1f} | "
            f"{1000 * percentile(row['latencies'], 99):.1f} | "
            f"{row['samples_per_s'] / local['samples_per_s']:.2f}x |"
        )
    print(
        f"\nremote / in-process per round: {', '.join(f'{r:.2f}' for r in result['ratios'])} "
        f"(median {statistics.median(result['ratios']):.2f})"
    )
    print(
        f"server start-up: {result['startup']:.2f} s in all, {result['networking']:.3f} s of it networking "
        f"(a DHT and announcing {args.experts} experts); hivemind's published figure: 11 s, 7.9 s networking"
    )


if __name__ == "__main__":
    main()
