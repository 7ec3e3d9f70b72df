"""Not tests: one rank of a multi-rank peer (a gloo job with DDP) for tests/test_distributed.py.

Every rank trains the MLP of tests/test_optimizer_peer.py under DDP with
`plexus.distributed.DistributedOptimizer`, on its own random rows, and records which rows it
contributed to each epoch (as `run_peer` does), so that `replay` can train one process on exactly
the swarm's global batches. Rank 0 of each job runs the DHT; job 0's bootstraps the others.
"""

import datetime
import functools
import os
import socket
import time

import torch

from plexus.averaging.allreduce import AllReduceRunner
from tests.test_optimizer_peer import FAST_TRACKER, LOCAL, NUM_SAMPLES, dataset, make_model


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class DyingRunner(AllReduceRunner):
    """The whole process dies in the middle of a gradient all-reduce, as if killed."""

    def outgoing(self, part, values):
        os._exit(17)


def run_rank(
    job: int,
    rank: int,
    world_size: int,
    port: int,
    config: dict,
    addresses,
    results,
    events,
    barrier=None,
    stop=None,
):
    """Train until `config["epochs"]` (or `config["more_epochs"]` after the first state load); put
    ("done", job, rank, outcome) on `results`, and rank 0 puts ("epoch", job, epoch) on `events`
    at each epoch change.

    `addresses`: a queue; job 0's rank 0 puts its multiaddrs there once per other job, and the
    other jobs' rank 0 take them. `barrier` (all ranks of all jobs that start together, or None)
    is passed once every optimizer is built. `stop` (an Event; single-rank jobs only, whose one
    rank decides alone) ends training. `config["die_at_epoch"]`: `(job, epoch)` whose rank 0 dies
    inside its first gradient all-reduce from that epoch on. `config["step_delay"]` paces the loop
    (compute time per batch; nothing waits on it). `config["no_dht"]`: rank 0 forgets its DHT.
    `config["out_of_order"]`: rank 1 asks for the optimizer state, then calls load_state_from_peers()
    where rank 0 calls step(). `config["stall"]`: seconds rank 0 hangs between its first backward
    and step (a stuck rank; its followers wait in step())."""
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
        timeout=datetime.timedelta(seconds=config.get("process_group_timeout", 30)),
    )
    dht = None
    if rank == 0 and not config.get("no_dht"):
        initial_peers = None if job == 0 else addresses.get(timeout=120)
        dht = DHT(initial_peers=initial_peers, start=True, host_maddrs=LOCAL)
        if job == 0:
            for _ in range(config.get("num_jobs", 1) - 1):
                addresses.put([str(a) for a in dht.get_visible_maddrs()])
    inputs, targets = dataset()
    model = DistributedDataParallel(make_model())
    batch = config.get("batch_size", 8)
    try:
        opt = DistributedOptimizer(
            dht=dht,
            run_id="run",
            target_batch_size=config["target_batch_size"],
            batch_size_per_step=batch,
            optimizer=functools.partial(torch.optim.SGD, lr=config.get("lr", 0.1)),
            params=model.parameters(),
            matchmaking_time=config.get("matchmaking_time", 1.0),
            averaging_timeout=config.get("averaging_timeout", 30.0),
            tracker_opts=FAST_TRACKER,
            timeout=config.get("timeout", 60.0),
            **config.get("options", {}),
        )
    except Exception as failure:  # a construction that fails must fail on every rank, and say why
        results.put(("done", job, rank, dict(error=(type(failure).__name__, str(failure), None))))
        return
    if barrier is not None:
        barrier.wait(90)
    generator = torch.Generator().manual_seed(1000 * job + rank)
    contributions: dict[int, list[int]] = {}
    pending: list[int] = []
    loaded_at, error, failed_at, refused = [], None, None, None
    deadline = time.monotonic() + config.get("deadline", 60)
    doomed, epochs = config.get("die_at_epoch"), config.get("epochs")
    try:
        with opt:  # leaving on an exception only leaves the swarm (no collective)
            while (
                (epochs is None or opt.local_epoch < epochs)
                and time.monotonic() < deadline
                and not (stop is not None and stop.is_set())
            ):
                if doomed is not None and doomed[0] == job and rank == 0 and opt.local_epoch >= doomed[1]:
                    opt.optimizer.grad_averager.allreduce_runner = DyingRunner
                epoch, loads = opt.local_epoch, opt.state_loads
                rows = torch.randint(0, NUM_SAMPLES, (batch,), generator=generator)
                ((model(inputs[rows]) - targets[rows]) ** 2).mean().backward()
                if config.get("stall") and rank == 0:
                    time.sleep(config.pop("stall"))  # a stuck rank, not a way to wait for anything
                if config.get("out_of_order") and rank == 1:
                    refused = _refused(opt.state_dict)
                    opt.load_state_from_peers()
                opt.step()
                opt.zero_grad()
                pending.extend(rows.tolist())
                if opt.state_loads != loads:
                    pending = []  # a download replaced the state: these rows never reached the swarm
                    loaded_at.append(opt.local_epoch)
                    if epochs is None and "more_epochs" in config:  # every rank reads the leader's epoch
                        epochs = opt.local_epoch + config["more_epochs"]
                elif opt.local_epoch != epoch:
                    contributions.setdefault(epoch, []).extend(pending)
                    pending = []
                if opt.local_epoch != epoch and rank == 0:
                    events.put(("epoch", job, opt.local_epoch))
                if config.get("step_delay"):
                    time.sleep(config["step_delay"])
    except Exception as failure:  # reported, and the test says whether it was expected
        error, failed_at = failure, time.time()
    outcome = dict(
        epoch=opt.local_epoch,
        params=[p.detach().clone().numpy() for p in model.parameters()],
        contributions=contributions,
        state_loads=opt.state_loads,
        loaded_at=loaded_at,
        rounds=opt.optimizer.rounds_averaged if opt.optimizer is not None else None,
        error=None if error is None else (type(error).__name__, str(error), getattr(error, "phase", None)),
        failed_at=failed_at,
        refused=refused,
    )
    if dht is not None:
        dht.shutdown()
    results.put(("done", job, rank, outcome))
    if error is None:
        dist.destroy_process_group()


def _refused(call) -> str | None:
    """The message of the UsageError that `call()` raised, or None."""
    from plexus.errors import UsageError

    try:
        call()
    except UsageError as error:
        return str(error)
    return None
