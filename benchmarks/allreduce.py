"""All-reduce benchmark: `DecentralizedAverager` (matchmaking + butterfly all-reduce) against gloo.

Run: `.venv/bin/python benchmarks/allreduce.py [--peers 2 4 8] [--mib 40 400] [--compression none float16]
[--rounds 3] [--quick] [--bare] [--profile] [--robust]`

Each peer is a spawned process with one torch thread, its own DHT on 127.0.0.1 and `--mib` MiB of
float32. Per (size, compression) the peers make a fresh averager (target group = all peers) and run
`--rounds` steps, each started at a barrier:
  * matchmaking: `step(require_trigger=True)` until the group is formed (everyone looks at once),
  * all-reduce: from `allow_allreduce()`, after a second barrier, until the step returns. This
    includes the averager's copies into and out of its private working copy.
After each averaging round the same processes run gloo's `all_reduce` (sum, then divide) on the
same tensor: the baseline, interleaved round by round so that both see the same load on a shared
machine. A round's time is its slowest peer's; the table shows the median over rounds.

Columns: s/round; algorithm bandwidth = tensor MiB / s per round (what nccl-tests and gloo call
algbw); the ratio to gloo's bandwidth; CPU seconds per round and peer (all threads, user + system)
for both, which a busy machine distorts far less than wall time (the all-reduce is CPU-bound: a
round's wall time is its CPU time plus its time waiting for a core); matchmaking seconds; peak
memory: the largest growth of a peer's resident set during an averaging round (VmHWM after
resetting it, else ru_maxrss) over its footprint with the input tensor allocated, divided by the
tensor size. The averager keeps its own copy and a working copy, so 2.0 is the design's floor; the
rest is parts in flight (windows of 4 parts per sender, stream buffers), a fixed few tens of MiB.
`--bare` adds rows for the all-reduce engine alone (`AllReduceRunner` over the group the averager
found, in place: no copies, no matchmaking). `--profile` prints peer 0's event-loop profile.
`--robust` averages with `RobustAggregation()` (CenteredClip per part, reducers verified): its cost
shows against the same run's gloo rounds, to compare with a run without it.
8 peers x 400 MiB needs about 1.3 GiB per peer (input, the averager's two copies, buffers).
"""

import argparse
import ctypes
import gc
import math
import multiprocessing as mp
import os
import re
import socket
import statistics
import sys
import time
from multiprocessing.connection import wait as wait_for_pipes

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil
import torch

from plexus.averaging.partition import DEFAULT_PART_SIZE_BYTES

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
COMPRESSIONS = ("none", "float16")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- memory ----------------------------------------------------------------------------------------


class PeakMemory:
    """Peak resident set growth of this process over a baseline taken at `reset()`.

    Linux lets a process reset its high-water mark (`echo 5 > /proc/self/clear_refs`); elsewhere
    the peak is the lifetime maximum (ru_maxrss), correct only for the first, largest measurement."""

    def __init__(self):
        self.process = psutil.Process()
        try:
            self._libc = ctypes.CDLL("libc.so.6")
        except OSError:
            self._libc = None
        self.baseline = 0

    def _trim(self) -> None:
        gc.collect()
        if self._libc is not None:
            self._libc.malloc_trim(0)  # hand freed heap back, so earlier rounds do not hide new growth

    def reset_peak(self) -> None:
        self._trim()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def reset(self) -> None:
        self.reset_peak()
        self.baseline = self.process.memory_info().rss

    def peak(self) -> int:
        try:
            with open("/proc/self/status") as f:
                hwm = int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024
        except (OSError, AttributeError):
            import resource

            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return max(hwm, self.process.memory_info().rss)


# --- one peer --------------------------------------------------------------------------------------


def make_compression(name: str):
    from plexus.compression import Float16Compression, NoCompression

    return {"none": NoCompression, "float16": Float16Compression}[name]()


def wait_for_group(control, deadline: float) -> None:
    """Poll (a benchmark may) until matchmaking is over; StepControl exposes no event for it."""
    from plexus.averaging.control import AveragingStage

    while control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP):
        if control.done():
            control.result()  # raises the step's error
            return
        if time.monotonic() > deadline:
            raise TimeoutError("matchmaking took longer than the benchmark's deadline")
        time.sleep(0.001)


def cpu_seconds() -> float:
    """CPU time of this whole process (every thread: the event loop, gloo's), user + system."""
    times = psutil.Process().cpu_times()
    return times.user + times.system


def one_step(averager, barrier, args, profile, dht):
    """One averaging step; returns (matchmaking s, all-reduce s, all-reduce CPU s, group)."""
    barrier.wait()
    started = time.perf_counter()
    control = averager.step(wait=False, require_trigger=True, timeout=args.step_timeout)
    wait_for_group(control, time.monotonic() + args.step_timeout)
    matchmaking = time.perf_counter() - started
    barrier.wait()
    if profile is not None:
        dht._background.loop.call_soon_threadsafe(profile.enable)
    cpu, started = cpu_seconds(), time.perf_counter()
    control.allow_allreduce()
    gathered = control.result()
    elapsed, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    if profile is not None:
        dht._background.run(_disable(profile))
    return matchmaking, elapsed, cpu, list(gathered)


def gloo_round(tensor, n, barrier):
    import torch.distributed as dist

    barrier.wait()
    cpu, started = cpu_seconds(), time.perf_counter()
    dist.all_reduce(tensor)
    tensor /= n
    return time.perf_counter() - started, cpu_seconds() - cpu


def run_config(index, n, mib, compression, args, barrier, dht, memory, profile) -> dict:
    """Rounds of the averager and of gloo, interleaved so both see the same load on a shared machine."""
    from plexus.averaging.aggregation import RobustAggregation
    from plexus.averaging.averager import DecentralizedAverager

    tensor = torch.randn(mib * 2**18, generator=torch.Generator().manual_seed(index))
    initial_sum = tensor.double().sum().item()
    memory.reset()
    baseline = memory.baseline
    averager = DecentralizedAverager(
        [tensor],
        dht,
        prefix=f"bench{n}x{mib}{compression}",
        target_group_size=n,
        min_group_size=n,
        min_matchmaking_time=args.min_matchmaking_time,
        request_timeout=args.request_timeout,
        compression=make_compression(compression),
        part_size_bytes=args.part_kib * 1024,
        sender_timeout=args.sender_timeout,
        reducer_timeout=2 * args.sender_timeout,
        start=True,
        robust=RobustAggregation() if args.robust else None,
    )
    result = {key: [] for key in ("matchmaking", "allreduce", "cpu", "gloo", "gloo_cpu", "bare")}
    growth = 0
    try:
        for _ in range(args.rounds):
            matchmaking, seconds, cpu, group = one_step(averager, barrier, args, profile, dht)
            assert len(group) == n, f"a group of {len(group)}, expected {n}"
            growth = max(growth, memory.peak() - baseline)
            for key, value in zip(("matchmaking", "allreduce", "cpu"), (matchmaking, seconds, cpu)):
                result[key].append(value)
            seconds, cpu = gloo_round(tensor, n, barrier)
            result["gloo"].append(seconds)
            result["gloo_cpu"].append(cpu)
            memory.reset_peak()
        with averager.get_tensors() as (averaged,):
            final_sum = averaged.double().sum().item()
            probe = averaged[:: max(1, averaged.numel() // 64)].tolist()  # no tensors through the pipe:
            # torch shares them by file descriptor, fetched from the sender after it may have exited
    finally:
        averager.shutdown()
    if args.bare:
        result["bare"] = bare_rounds(tensor, n, compression, args, barrier, dht, group)
    result.update(
        numel=tensor.numel(), growth=growth, initial_sum=initial_sum, final_sum=final_sum, probe=probe
    )
    return result


async def _disable(profile) -> None:
    profile.disable()


def bare_rounds(tensor, n, compression, args, barrier, dht, group) -> list[float]:
    """The engine alone: AllReduceRunner in place over the averager's group (same order everywhere)."""
    from plexus.averaging.allreduce import AllReduceRouter, AllReduceRunner
    from plexus.averaging.averager import _routers  # the router the averager put on this host

    peers = sorted(group, key=lambda peer: peer.to_bytes())
    times = []
    for round_index in range(args.rounds):

        async def one_round():
            router = _routers.get(dht.host) or AllReduceRouter(dht.host)
            runner = AllReduceRunner(
                dht.host,
                f"bare-{n}-{round_index}".encode(),
                [tensor],
                peers,
                [1.0] * n,
                compression=make_compression(compression),
                part_size_bytes=args.part_kib * 1024,
                sender_timeout=args.sender_timeout,
                reducer_timeout=2 * args.sender_timeout,
            )
            with router.register(runner):
                started = time.perf_counter()
                report = await runner.run()
                elapsed = time.perf_counter() - started
            assert report.complete, report
            return elapsed

        barrier.wait()
        times.append(dht._background.run(one_round()))
    return times


def peer(index: int, n: int, configs, args, connection, barrier, gloo_port: int) -> None:
    import faulthandler

    faulthandler.enable()  # a crash in native code names itself instead of a silently closed pipe
    torch.set_num_threads(args.threads)
    import torch.distributed as dist

    from plexus.dht.dht import DHT

    if index == 0:
        dht = DHT(start=True, host_maddrs=LOCAL)
        connection.send([str(addr) for addr in dht.get_visible_maddrs()])
    else:
        dht = DHT(initial_peers=connection.recv(), start=True, host_maddrs=LOCAL)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=index, world_size=n)
    memory = PeakMemory()
    profile = None
    if args.profile and index == 0:
        import cProfile

        profile = cProfile.Profile()
    try:
        for mib, compression in configs:
            connection.send(run_config(index, n, mib, compression, args, barrier, dht, memory, profile))
    except BaseException as error:  # send it as text: not every exception pickles
        import traceback

        connection.send(
            RuntimeError(f"peer {index}: {type(error).__name__}: {error}\n{traceback.format_exc()}")
        )
        raise
    finally:
        dist.destroy_process_group()
        dht.shutdown()
    if profile is not None:
        import pstats

        print(f"\n--- peer 0's event loop during the all-reduce rounds, {n} peers ---", file=sys.stderr)
        pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    connection.close()
    os._exit(0)  # skip the interpreter's teardown: collecting torch's modules takes seconds


# --- the driver ------------------------------------------------------------------------------------


def slowest(results, key) -> float:
    """Median over rounds of the slowest peer's time."""
    return statistics.median(max(rounds) for rounds in zip(*(result[key] for result in results)))


def mean_cpu(results, key) -> float:
    """Median over rounds of the peers' mean CPU seconds."""
    return statistics.median(
        sum(rounds) / len(rounds) for rounds in zip(*(result[key] for result in results))
    )


def check(results, n, compression) -> str:
    """The group's result: the mean's sum is the mean of the sums; uncompressed, peers agree exactly."""
    expected = sum(result["initial_sum"] for result in results) / n
    finals = [result["final_sum"] for result in results]
    # rounding errors of N averaged values add up like a random walk: sqrt(N) x per-value error
    tolerance = math.sqrt(results[0]["numel"]) * (1e-6 if compression == "none" else 1e-2)
    if any(abs(final - expected) > tolerance for final in finals):
        return f"WRONG SUM {finals} vs {expected}"
    if compression == "none" and any(result["probe"] != results[0]["probe"] for result in results):
        return "PEERS DIFFER"
    return "ok"


def run_peers(n: int, args, rows: list) -> None:
    configs = [(mib, compression) for mib in args.mib for compression in args.compression]
    context = mp.get_context("spawn")
    barrier, gloo_port = context.Barrier(n), free_port()
    pipes = [context.Pipe() for _ in range(n)]
    processes = [
        context.Process(target=peer, args=(i, n, configs, args, pipes[i][1], barrier, gloo_port), daemon=True)
        for i in range(n)
    ]
    for process in processes:
        process.start()
    finished = False
    try:
        addresses = pipes[0][0].recv()
        for parent, _ in pipes[1:]:
            parent.send(addresses)
        for mib, compression in configs:
            results = gather_results([parent for parent, _ in pipes], f"{n} peers x {mib} MiB {compression}")
            row = dict(
                peers=n,
                mib=mib,
                compression=compression,
                seconds=slowest(results, "allreduce"),
                gloo=slowest(results, "gloo"),
                cpu=mean_cpu(results, "cpu"),
                gloo_cpu=mean_cpu(results, "gloo_cpu"),
                matchmaking=slowest(results, "matchmaking"),
                growth=max(r["growth"] for r in results) / (mib << 20),
                bare=slowest(results, "bare") if args.bare else None,
                check=check(results, n, compression),
            )
            rows.append(row)
            print(format_row(row), flush=True)
        finished = True
    except (EOFError, ConnectionError) as error:
        for process in processes:
            process.join(timeout=5)
        codes = [process.exitcode for process in processes]
        raise RuntimeError(f"a peer process died ({error!r}); exit codes {codes}") from None
    finally:  # after a failure the others may wait on a barrier for the failed peer forever
        for process in processes:
            process.join(timeout=60 if finished else 1)
            if process.is_alive():
                process.kill()


def gather_results(parents: list, what: str) -> list:
    """Every peer's result, in order; raises at the first error or death rather than waiting for
    peers that may never answer (they wait on a barrier for the failed one)."""
    results, pending = [None] * len(parents), {parent: index for index, parent in enumerate(parents)}
    while pending:
        for parent in wait_for_pipes(list(pending)):
            result = parent.recv()  # EOFError if the peer died without a word
            if isinstance(result, BaseException):
                raise RuntimeError(f"{what}: {result!r}")
            results[pending.pop(parent)] = result
    return results


HEADER = (
    "| peers | MiB | compression | s/round | MiB/s | gloo s/round | gloo MiB/s | vs gloo "
    "| CPU s/round/peer (gloo) | matchmaking s | peak mem / tensor | check |"
)


def format_row(row) -> str:
    bandwidth, gloo_bandwidth = row["mib"] / row["seconds"], row["mib"] / row["gloo"]
    text = (
        f"| {row['peers']} | {row['mib']} | {row['compression']} | {row['seconds']:.3f} | {bandwidth:.0f} "
        f"| {row['gloo']:.3f} | {gloo_bandwidth:.0f} | {bandwidth / gloo_bandwidth:.2f} "
        f"| {row['cpu']:.2f} ({row['gloo_cpu']:.2f}) | {row['matchmaking']:.3f} | {row['growth']:.2f} "
        f"| {row['check']} |"
    )
    if row["bare"] is not None:
        bare = row["mib"] / row["bare"]
        text += (
            f"\n| {row['peers']} | {row['mib']} | {row['compression']}, bare runner | {row['bare']:.3f} "
            f"| {bare:.0f} | | | {bare / gloo_bandwidth:.2f} | | | | |"
        )
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--mib", type=int, nargs="+", default=[40, 400], help="MiB of float32 per peer")
    parser.add_argument("--compression", nargs="+", choices=COMPRESSIONS, default=list(COMPRESSIONS))
    parser.add_argument("--rounds", type=int, default=3, help="rounds per row; the median is shown")
    parser.add_argument("--quick", action="store_true", help="2 and 4 peers, 40 MiB, 2 rounds")
    parser.add_argument("--bare", action="store_true", help="also time the bare AllReduceRunner")
    parser.add_argument("--part-kib", type=int, default=DEFAULT_PART_SIZE_BYTES >> 10)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per peer")
    parser.add_argument("--min-matchmaking-time", type=float, default=5.0)
    parser.add_argument("--request-timeout", type=float, default=3.0)
    parser.add_argument("--sender-timeout", type=float, default=60.0)
    parser.add_argument("--step-timeout", type=float, default=600.0)
    parser.add_argument(
        "--profile", action="store_true", help="print peer 0's event-loop profile of the rounds"
    )
    parser.add_argument("--robust", action="store_true", help="CenteredClip per part and verified reducers")
    args = parser.parse_args()
    if args.quick:
        args.peers, args.mib, args.rounds = [p for p in args.peers if p <= 4] or [2], [40], 2

    print(
        f"{os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB; {args.rounds} rounds per row, "
        f"parts of {args.part_kib} KiB, {args.threads} torch thread(s) per peer\n"
    )
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    rows = []
    for n in args.peers:
        try:
            run_peers(n, args, rows)
        except Exception as error:  # one peer count failing (memory, timeouts) must not hide the others
            print(f"| {n} | | | did not run: {error} |", flush=True)


if __name__ == "__main__":
    main()
