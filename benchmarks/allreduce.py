"""All-reduce benchmark: Plexus butterfly all-reduce against torch.distributed gloo, same processes.

Run: `.venv/bin/python benchmarks/allreduce.py [--peers 2] [--mib 40] [--rounds 3] [--part-kib 512]`

Each peer is a spawned process with its own Host on 127.0.0.1 and `--mib` MiB of float32. Every
round starts at a barrier; a round's time is the slowest peer's. Then the same processes run gloo's
`all_reduce` (sum, then divide) on the same tensor, as the baseline measured in the same run.
Printed: median seconds per round, the vector size over that time (MiB/s) and the ratio to gloo.
"""

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from plexus.averaging.allreduce import AllReduceRouter, AllReduceRunner  # noqa: E402
from plexus.p2p.host import Host  # noqa: E402
from plexus.p2p.identity import PeerID  # noqa: E402
from plexus.p2p.multiaddr import Multiaddr  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer(index: int, args, connection, barrier, gloo_port: int) -> None:
    torch.set_num_threads(args.threads)
    tensor = torch.randn(args.mib * 2**18, generator=torch.Generator().manual_seed(index))

    async def plexus_rounds() -> list[float]:
        host = await Host(host_maddrs=("/ip4/127.0.0.1/tcp/0",)).start()
        router = AllReduceRouter(host)
        connection.send((host.peer_id.to_bytes(), [str(a) for a in host.get_listen_maddrs()]))
        peers = connection.recv()
        peer_ids = [PeerID(raw) for raw, _ in peers]
        for peer_id, (_, addrs) in zip(peer_ids, peers):
            if peer_id != host.peer_id:
                host.add_addrs(peer_id, [Multiaddr(a) for a in addrs])
                await host.connect(peer_id)
        times = []
        for round_index in range(args.rounds):
            runner = AllReduceRunner(host, f"round-{round_index}".encode(), [tensor], peer_ids, [1] * len(peer_ids),
                                     part_size_bytes=args.part_kib * 1024, sender_timeout=30, reducer_timeout=60)
            await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
            started = time.perf_counter()
            with router.register(runner):
                report = await runner.run()
            times.append(time.perf_counter() - started)
            assert report.complete, report
        await host.shutdown()
        return times

    if args.profile and index == 0:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        plexus_times = profile.runcall(asyncio.run, plexus_rounds())
        pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(15)
    else:
        plexus_times = asyncio.run(plexus_rounds())

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=index, world_size=args.peers)
    gloo_times = []
    for _ in range(args.rounds):
        barrier.wait()
        started = time.perf_counter()
        dist.all_reduce(tensor)
        tensor /= args.peers
        gloo_times.append(time.perf_counter() - started)
    dist.destroy_process_group()
    connection.send((plexus_times, gloo_times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--mib", type=int, default=40, help="MiB of float32 per peer")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--part-kib", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per peer")
    parser.add_argument("--profile", action="store_true", help="print peer 0's profile of the plexus rounds")
    args = parser.parse_args()

    context = mp.get_context("spawn")
    barrier, gloo_port = context.Barrier(args.peers), free_port()
    pipes = [context.Pipe() for _ in range(args.peers)]
    processes = [context.Process(target=peer, args=(i, args, pipes[i][1], barrier, gloo_port), daemon=True)
                 for i in range(args.peers)]
    for process in processes:
        process.start()
    addresses = [parent.recv() for parent, _ in pipes]
    for parent, _ in pipes:
        parent.send(addresses)
    results = [parent.recv() for parent, _ in pipes]
    for process in processes:
        process.join()

    def per_round(index: int) -> float:
        return statistics.median(max(result[index][r] for result in results) for r in range(args.rounds))

    plexus, gloo = per_round(0), per_round(1)
    print(f"{args.peers} peers x {args.mib} MiB float32, {args.rounds} rounds, parts of {args.part_kib} KiB")
    print(f"{'method':<22}{'s/round':>10}{'MiB/s':>10}{'vs gloo':>10}")
    for name, seconds in (("plexus butterfly", plexus), ("gloo all_reduce", gloo)):
        print(f"{name:<22}{seconds:>10.3f}{args.mib / seconds:>10.1f}{gloo / seconds:>10.2f}")


if __name__ == "__main__":
    main()
