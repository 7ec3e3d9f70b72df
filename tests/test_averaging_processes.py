"""DecentralizedAverager across separate processes: exact weighted means, gathers and every mode.

One module-scoped pool of spawned worker processes (each with one torch thread and its own DHT)
serves every test: starting a process that imports torch costs seconds on a loaded machine, so the
workers start once, in parallel, and each test runs rounds with a subset of them. Every round gets a
fresh prefix (no stale declarations) and a fresh averager per worker. The reference is the weighted
mean in float64 computed here from the same seeded tensors.
"""

import multiprocessing as mp
import os
import time
from dataclasses import dataclass

import pytest
import torch

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
ROUND_TIMEOUT = 45.0  # seconds a round may take on a loaded 2-core machine
PART_SIZE_BYTES = 16 << 10  # small parts: every span is cut into many, so rounds pipeline


def tensors_of(seed: int) -> list[torch.Tensor]:
    """A float32 vector long enough for many parts, a float64 matrix, and a float32 scalar tensor."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(50_000, generator=generator),
        torch.randn(7, 13, generator=generator, dtype=torch.float64),
        torch.randn((), generator=generator) * 1000,
    ]


# --- the worker process ---------------------------------------------------------------------------


def _worker(connection) -> None:
    torch.set_num_threads(1)
    from plexus.averaging.averager import DecentralizedAverager
    from plexus.dht.dht import DHT

    initial_peers = connection.recv()
    dht = DHT(initial_peers=initial_peers, start=True, host_maddrs=LOCAL)
    connection.send([str(addr) for addr in dht.get_visible_maddrs()])
    client_dht = None
    try:
        while (job := connection.recv()) is not None:
            try:
                if job["mode"] == "client" and client_dht is None:
                    client_dht = DHT(
                        initial_peers=initial_peers or dht.get_visible_maddrs(), start=True, client_mode=True
                    )
                averager = DecentralizedAverager(
                    tensors_of(job["seed"]),
                    client_dht if job["mode"] == "client" else dht,
                    prefix=job["prefix"],
                    target_group_size=job["group_size"],
                    min_group_size=job["group_size"],
                    min_matchmaking_time=2.0,
                    request_timeout=1.0,
                    part_size_bytes=PART_SIZE_BYTES,
                    bandwidth=job["bandwidth"],
                    auxiliary=job["mode"] == "aux",
                    allow_state_sharing=False,
                    start=True,
                )
                try:
                    started = time.perf_counter()
                    weight = 0.0 if job["mode"] == "aux" else job["weight"]
                    gathered = averager.step(gather=job["gather"], weight=weight, timeout=ROUND_TIMEOUT - 5)
                    elapsed = time.perf_counter() - started
                    with averager.get_tensors() as tensors:
                        averaged = [tensor.clone() for tensor in tensors]
                    connection.send(
                        dict(
                            peer_id=averager.peer_id.to_bytes(),
                            mode=averager.mode.name,
                            seconds=elapsed,
                            tensors=averaged,
                            gathered={peer.to_bytes(): data for peer, data in gathered.items()},
                        )
                    )
                finally:
                    averager.shutdown()
            except Exception as error:  # report it to the test, keep serving
                connection.send(dict(error=f"{type(error).__name__}: {error}"))
    finally:
        for each in (client_dht, dht):
            if each is not None:
                each.shutdown()
    connection.close()
    os._exit(0)  # skip the interpreter's teardown: collecting torch's modules takes seconds here


@dataclass
class Worker:
    process: mp.Process
    connection: object


class Pool:
    """Worker processes started on demand (in parallel) and kept for the whole module."""

    def __init__(self):
        self.context = mp.get_context("spawn")
        self.workers: list[Worker] = []
        self.bootstrap: list[str] | None = None
        self.rounds = 0

    def ensure(self, count: int, timeout: float = 90) -> None:
        new = []
        for _ in range(count - len(self.workers)):
            parent, child = self.context.Pipe()
            process = self.context.Process(target=_worker, args=(child,), daemon=True)
            process.start()
            new.append(Worker(process, parent))
        deadline = time.monotonic() + timeout
        if self.bootstrap is None and new:  # the first worker starts the swarm; the rest import meanwhile
            first = new[0]
            first.connection.send([])
            self.bootstrap = self._receive(first, deadline, "start its DHT")
            self.workers.append(new.pop(0))
        for worker in new:
            worker.connection.send(self.bootstrap)
        for worker in new:
            self._receive(worker, deadline, "join the DHT")
            self.workers.append(worker)

    def _receive(self, worker: Worker, deadline: float, what: str):
        if not worker.connection.poll(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"worker {worker.process.pid} did not {what} in time")
        return worker.connection.recv()

    def run_round(self, jobs: dict[int, dict]) -> dict[int, dict]:
        """Run one round: `jobs` maps worker index to its part; returns each worker's report."""
        self.ensure(max(jobs) + 1)
        self.rounds += 1
        prefix = f"round{self.rounds}"
        for index, job in jobs.items():
            self.workers[index].connection.send(dict(job, prefix=prefix, group_size=len(jobs)))
        deadline = time.monotonic() + ROUND_TIMEOUT
        reports = {index: self._receive(self.workers[index], deadline, "finish its round") for index in jobs}
        errors = {index: report["error"] for index, report in reports.items() if "error" in report}
        assert not errors, f"round failed on workers {errors}"
        return reports

    def close(self) -> None:
        for worker in self.workers:
            try:
                worker.connection.send(None)
            except OSError:
                pass
        for worker in self.workers:
            worker.process.join(10)
            if worker.process.is_alive():
                worker.process.kill()


@pytest.fixture(scope="module")
def pool():
    pool = Pool()
    try:
        yield pool
    finally:
        pool.close()


# --- checks ---------------------------------------------------------------------------------------


def job(seed: int, weight: float = 1.0, mode: str = "node", bandwidth: float | None = None) -> dict:
    return dict(seed=seed, weight=weight, mode=mode, bandwidth=bandwidth, gather={"seed": seed, "mode": mode})


def check_round(jobs: dict[int, dict], reports: dict[int, dict]) -> None:
    contributors = {i: j for i, j in jobs.items() if j["mode"] != "aux" and j["weight"] > 0}
    total = sum(j["weight"] for j in contributors.values())
    sources = {i: tensors_of(j["seed"]) for i, j in jobs.items()}
    expected = [
        sum(j["weight"] * sources[i][k].double() for i, j in contributors.items()) / total
        for k in range(len(next(iter(sources.values()))))
    ]
    magnitude = [
        sum(j["weight"] * sources[i][k].double().abs() for i, j in contributors.items()) / total
        for k in range(len(expected))
    ]
    members = {report["peer_id"] for report in reports.values()}
    assert len(members) == len(jobs)
    receivers = []
    for index, report in reports.items():
        assert report["mode"] == {"node": "NODE", "client": "CLIENT", "aux": "AUX"}[jobs[index]["mode"]]
        assert set(report["gathered"]) == members, "every member gets every member's gather"
        assert sorted(g["seed"] for g in report["gathered"].values()) == sorted(
            j["seed"] for j in jobs.values()
        )
        if jobs[index]["mode"] == "aux":
            for tensor, source in zip(report["tensors"], sources[index]):
                assert torch.equal(tensor, source), "an auxiliary peer's tensors are left alone"
            continue
        receivers.append(report)
        for tensor, source, target, scale in zip(report["tensors"], sources[index], expected, magnitude):
            assert tensor.dtype == source.dtype and tensor.shape == source.shape
            # float32 accumulates in float32: each of <= 8 weighted terms adds <= 1 ulp of the running sum
            relative = 1e-12 if tensor.dtype == torch.float64 else 1e-6
            error = (tensor.double() - target).abs()
            bound = relative * scale + 1e-30
            assert bool((error <= bound).all()), (
                f"worker {index}: max error {float((error / bound).max()):.2f}x the bound {relative} * |x|"
            )
    for report in receivers[1:]:  # uncompressed answers are shared: every receiver ends bit-identical
        for tensor, first in zip(report["tensors"], receivers[0]["tensors"]):
            assert torch.equal(tensor, first)


# --- the tests ------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4])
def test_exact_weighted_means_and_gathers(pool, n):
    jobs = {i: job(seed=10 * n + i, weight=1.0 + 0.5 * i, bandwidth=1.0 + i % 3) for i in range(n)}
    check_round(jobs, pool.run_round(jobs))


@pytest.mark.timeout(120)
def test_zero_weight_peer_receives_the_mean_of_the_others(pool):
    jobs = {0: job(seed=1, weight=2.0), 1: job(seed=2, weight=0.0), 2: job(seed=3, weight=0.25)}
    check_round(jobs, pool.run_round(jobs))


@pytest.mark.timeout(120)
def test_client_and_auxiliary_peers_among_nodes(pool):
    """Worker 3 averages through a client-mode DHT (no listening address): it only sends and
    receives; worker 2 is auxiliary: it reduces a span for the others and keeps its own tensors."""
    jobs = {
        0: job(seed=5, weight=1.0),
        1: job(seed=6, weight=3.0),
        2: job(seed=7, mode="aux"),
        3: job(seed=8, weight=2.0, mode="client"),
    }
    check_round(jobs, pool.run_round(jobs))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_eight_peers_with_every_mode(pool):
    jobs = {i: job(seed=100 + i, weight=float(i % 3 + 1), bandwidth=1.0 + i % 2) for i in range(8)}
    jobs[6] = job(seed=106, mode="aux")
    jobs[7] = job(seed=107, weight=1.5, mode="client")
    check_round(jobs, pool.run_round(jobs))
    everyone = {i: job(seed=200 + i, weight=1.0 + i) for i in range(8)}
    check_round(everyone, pool.run_round(everyone))
