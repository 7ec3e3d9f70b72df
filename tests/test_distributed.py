"""Peers that are `torch.distributed` jobs (gloo, DDP, CPU), training with plexus.distributed.

Every rank is a spawned process (tests/distributed_rank.py); the jobs meet over 127.0.0.1.

Equivalence tolerance (1e-6 absolute, as in tests/test_optimizer_equivalence.py, whose reasoning
holds here): the swarm's global step is the mean gradient over every row of the epoch, like the
replay's, and only the summation order differs (DDP sums each job's two ranks, the all-reduce
the jobs' means): a few float32 ulps per epoch. The test measures the float32 replay's distance
from a float64 one to show that the tolerance is not hiding more, and that misplacing a single
micro-batch of 8 rows moves the parameters by over 100 times the tolerance.
"""

import datetime
import multiprocessing
import time

import pytest
import torch
import torch.distributed as dist

from plexus.distributed import DistributedOptimizer, Job
from plexus.errors import UsageError
from tests.distributed_rank import free_port, run_rank
from tests.test_optimizer_peer import LOCAL, replay

# Each multi-process test takes 20-40 s on an idle machine; the timeouts leave room for a loaded one
# (each rank process imports torch).
pytestmark = pytest.mark.timeout(240)
EPOCHS, LR, TOLERANCE = 4, 0.1, 1e-6
CONTEXT = multiprocessing.get_context("spawn")


class Swarm:
    """Jobs of spawned ranks, their queues, and their outcomes by (job, rank)."""

    def __init__(self):
        self.addresses, self.results, self.events = CONTEXT.Queue(), CONTEXT.Queue(), CONTEXT.Queue()
        self.processes: dict[tuple[int, int], multiprocessing.Process] = {}
        self.outcomes: dict[tuple[int, int], dict] = {}

    def start(self, job: int, world_size: int, config: dict, barrier=None, stop=None) -> None:
        port = free_port()
        for rank in range(world_size):
            args = (job, rank, world_size, port, config, self.addresses, self.results, self.events)
            process = CONTEXT.Process(target=run_rank, args=(*args, barrier, stop), daemon=True)
            process.start()
            self.processes[job, rank] = process

    def wait_for_epoch(self, job: int, epoch: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            kind, which, reached = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            if kind == "epoch" and which == job and reached >= epoch:
                return

    def collect(self, keys, timeout: float) -> dict[tuple[int, int], dict]:
        deadline = time.monotonic() + timeout
        while not set(keys) <= set(self.outcomes):
            _, job, rank, outcome = self.results.get(timeout=max(0.0, deadline - time.monotonic()))
            self.outcomes[job, rank] = outcome
        return self.outcomes

    def close(self) -> None:
        for process in self.processes.values():
            process.join(10)
            if process.is_alive():
                process.kill()


@pytest.fixture
def swarm():
    swarm = Swarm()
    yield swarm
    swarm.close()


def assert_same_parameters(outcomes: list[dict]) -> None:
    reference = outcomes[0]["params"]
    for outcome in outcomes[1:]:
        for mine, theirs in zip(reference, outcome["params"]):
            assert torch.equal(torch.from_numpy(mine), torch.from_numpy(theirs))


@pytest.mark.slow
def test_two_jobs_of_two_ranks_train_like_one_process_with_the_global_batch(swarm):
    config = dict(
        num_jobs=2,
        target_batch_size=64,
        epochs=EPOCHS,
        lr=LR,
        # groups of both jobs: a round without one of them would be a different computation
        options=dict(averager_opts=dict(target_group_size=2, min_group_size=2)),
    )
    barrier = CONTEXT.Barrier(4)
    for job in range(2):
        swarm.start(job, 2, config, barrier)
    keys = [(job, rank) for job in range(2) for rank in range(2)]
    outcomes = swarm.collect(keys, timeout=180)

    assert all(outcomes[key]["error"] is None for key in keys), [outcomes[key]["error"] for key in keys]
    assert [outcomes[key]["epoch"] for key in keys] == [EPOCHS] * 4
    assert_same_parameters([outcomes[key] for key in keys])  # ranks mirror their leader, jobs average
    for job in range(2):
        assert outcomes[job, 0]["rounds"] >= EPOCHS - 1, "the jobs averaged, not stepped alone"

    contributions = [outcomes[key]["contributions"] for key in keys]
    expected, _ = replay(contributions, EPOCHS, LR)
    in_float64, _ = replay(contributions, EPOCHS, LR, dtype=torch.float64)
    misplaced, _ = replay(contributions, EPOCHS, LR, drop_first_batch=True)
    final = [torch.from_numpy(p) for p in outcomes[0, 0]["params"]]
    error = max(float((a - b).abs().max()) for a, b in zip(final, expected))
    rounding = max(float((a.double() - b).abs().max()) for a, b in zip(expected, in_float64))
    one_batch = max(float((a - b).abs().max()) for a, b in zip(misplaced, expected))
    print(
        f"jobs vs replay {error:.2e}, float32 vs float64 {rounding:.2e}, one batch misplaced {one_batch:.2e}"
    )
    assert rounding < TOLERANCE / 3 and one_batch > 100 * TOLERANCE
    assert error <= TOLERANCE, f"the jobs differ from the one-process replay by {error:.2e}"


@pytest.mark.slow
def test_a_newcomer_job_loads_the_state_on_rank_0_and_hands_it_to_its_ranks(swarm):
    stop = CONTEXT.Event()
    # epochs of about a second: much shorter ones, and the two peers often miss each other's rounds
    training = dict(num_jobs=2, target_batch_size=256, step_delay=0.05, deadline=180)
    swarm.start(0, 1, dict(training), stop=stop)  # a one-rank job keeps the swarm going
    swarm.wait_for_epoch(0, 2, timeout=120)
    swarm.start(1, 2, dict(training, more_epochs=5))
    outcomes = swarm.collect([(1, 0), (1, 1)], timeout=120)
    stop.set()
    swarm.collect([(0, 0)], timeout=30)

    newcomer = [outcomes[1, 0], outcomes[1, 1]]
    assert all(outcome["error"] is None for outcome in newcomer), [o["error"] for o in newcomer]
    for outcome in newcomer:
        assert outcome["state_loads"] >= 1 and outcome["loaded_at"][0] >= 2, "loaded the swarm's epoch"
    assert newcomer[0]["loaded_at"] == newcomer[1]["loaded_at"]
    assert newcomer[0]["epoch"] == newcomer[1]["epoch"] >= newcomer[0]["loaded_at"][0] + 5
    assert_same_parameters(newcomer)
    assert newcomer[0]["rounds"] >= 1, "after loading, the newcomer averaged with the swarm"
    assert outcomes[0, 0]["error"] is None


@pytest.mark.slow
def test_a_rank_dying_mid_round_fails_its_job_cleanly_and_the_swarm_trains_on(swarm):
    config = dict(
        num_jobs=2,
        target_batch_size=64,
        epochs=6,
        step_delay=0.02,
        averaging_timeout=10.0,
        timeout=20.0,
        die_at_epoch=(1, 2),
    )
    barrier = CONTEXT.Barrier(3)
    swarm.start(0, 1, config, barrier)
    swarm.start(1, 2, config, barrier)
    leader = swarm.processes[1, 0]
    leader.join(120)
    assert leader.exitcode == 17, "job 1's rank 0 died inside a gradient all-reduce"
    died = time.time()
    outcomes = swarm.collect([(1, 1)], timeout=config["timeout"] + 10)
    survivor = outcomes[1, 1]
    assert survivor["error"] is not None and survivor["error"][0] == "RankFailed", survivor["error"]
    assert survivor["error"][2] == "step" and "rank 0" in survivor["error"][1]
    assert survivor["failed_at"] - died < config["timeout"], (
        "no hang: the follower stopped within the timeout"
    )
    assert survivor["epoch"] == 2
    other = swarm.collect([(0, 0)], timeout=60)[0, 0]
    assert other["error"] is None and other["epoch"] == 6, "the other peer trained on"


@pytest.mark.timeout(60)
def test_rank_0_without_a_dht_fails_every_rank_at_construction(swarm):
    swarm.start(0, 2, dict(no_dht=True, target_batch_size=64, epochs=1))
    outcomes = swarm.collect([(0, 0), (0, 1)], timeout=50)
    assert outcomes[0, 0]["error"][0] == "UsageError" and "dht" in outcomes[0, 0]["error"][1]
    assert outcomes[0, 1]["error"][0] == "RankFailed" and "construction" in outcomes[0, 1]["error"][1]


@pytest.mark.timeout(90)
def test_ranks_calling_different_methods_fail_instead_of_mixing_up(swarm):
    swarm.start(0, 2, dict(out_of_order=True, target_batch_size=64, epochs=1))
    outcomes = swarm.collect([(0, 0), (0, 1)], timeout=80)
    follower = outcomes[0, 1]
    assert follower["refused"] is not None and "rank 0" in follower["refused"], "state_dict lives on rank 0"
    assert follower["error"][0] == "RankFailed" and "same methods in the same order" in follower["error"][1]
    assert outcomes[0, 0]["error"] is not None, "rank 0 stopped too (its next collective lost rank 1)"


@pytest.mark.timeout(90)
def test_a_stalled_leader_fails_its_followers_after_the_timeout(swarm):
    config = dict(stall=8.0, timeout=3.0, target_batch_size=64, epochs=1)
    swarm.start(0, 2, config)
    follower = swarm.collect([(0, 1)], timeout=80)[0, 1]
    assert follower["error"][0] == "RankFailed" and "did not answer within 3 s" in follower["error"][1]
    assert follower["error"][2] == "step"


@pytest.fixture
def single_rank_group():
    """A one-rank gloo group in this process (no port: an in-memory store)."""
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=10)
    )
    yield
    dist.destroy_process_group()


def test_a_job_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(UsageError, match="init_process_group"):
        Job(timeout=10)


def test_unsupported_options_are_refused(single_rank_group):
    model = torch.nn.Linear(2, 1)
    for option in ("reuse_grad_buffers", "auxiliary"):
        with pytest.raises(UsageError, match=option):
            DistributedOptimizer(optimizer=torch.optim.SGD, params=model.parameters(), **{option: True})
    with pytest.raises(UsageError, match="positive"):
        Job(timeout=0)


def test_a_one_rank_job_is_a_plain_peer(single_rank_group):
    from plexus.dht.dht import DHT

    dht = DHT(start=True, host_maddrs=LOCAL)
    model = torch.nn.Linear(4, 1)
    before = [p.detach().clone() for p in model.parameters()]
    with DistributedOptimizer(
        dht=dht,
        run_id="alone",
        target_batch_size=16,
        batch_size_per_step=4,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        params=model.parameters(),
    ) as opt:
        assert opt.is_leader and opt.optimizer is not None
        with pytest.raises(UsageError, match="GradScaler"):
            opt.step(grad_scaler=object())
        while opt.local_epoch < 2:
            model(torch.randn(4, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert opt.state_dict()["state"]["local_epoch"] == 2
    dht.shutdown()
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
