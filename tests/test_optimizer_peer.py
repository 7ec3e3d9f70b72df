"""Not tests: one training peer for the Optimizer tests, run in a thread or in a spawned process.

A peer trains a small MLP on a fixed synthetic regression set and records, for every `step()`,
which sample indices it used and how its epoch and state loads moved. From that it derives which
samples it *contributed* to each epoch: the batches accumulated since its last epoch change, when
that change was a normal global step (not a state download, which discards them). A replay can
then train one model on exactly the swarm's global batches (`replay`).
"""

import functools
import logging
import os
import time

import torch

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
FAST_TRACKER = dict(min_refresh_period=0.05, max_refresh_period=1.0, default_refresh_period=0.2)
NUM_SAMPLES, NUM_FEATURES, HIDDEN = 512, 16, 32


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(NUM_SAMPLES, NUM_FEATURES, generator=generator)
    targets = torch.sin(inputs @ torch.randn(NUM_FEATURES, 1, generator=generator)) + 0.1 * inputs[:, :1]
    return inputs, targets


def make_model(hidden: int = HIDDEN) -> torch.nn.Module:
    torch.manual_seed(0)  # every peer and the replay start from the same parameters
    return torch.nn.Sequential(
        torch.nn.Linear(NUM_FEATURES, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
    )


def full_loss(model: torch.nn.Module, inputs, targets) -> float:
    with torch.no_grad():
        return float(((model(inputs) - targets) ** 2).mean())


def run_peer(
    index: int, config: dict, initial_peers=None, results=None, barrier=None, events=None, stop=None
):
    """Train until `config["epochs"]` (or `config["deadline"]` seconds); report through `results`.

    Parameters come back as numpy arrays: torch tensors would cross a process boundary as shared
    memory handles that die with the peer.

    `stop` (an Event) ends training early. `config["step_delay"]` stands for compute time per
    batch (it paces the loop; nothing waits on it). `initial_peers`: multiaddrs, or a queue that will deliver them (processes start importing
    torch before the first peer is up). `results` is a dict (threads) or a queue (processes); `events` (a queue) receives
    ("maddrs", index, [...]) once the DHT is up and ("epoch", index, epoch) at each epoch change.

    Faulty members: `config["nan_every"]` makes every k-th batch's loss NaN, `config["grad_scale"]`
    multiplies the gradients before each step, `config["runner"]` is the all-reduce class of its
    gradient rounds (a subclass overriding the runner's `outgoing`/`reduced` seams).
    """
    from plexus.dht.dht import DHT
    from plexus.optim.optimizer import Optimizer

    torch.set_num_threads(1)
    if initial_peers is not None and not isinstance(initial_peers, (list, tuple)):
        initial_peers = initial_peers.get(timeout=120)  # a queue: started before the first peer was up
    if config.get("log_level"):
        logging.basicConfig(
            level=config["log_level"], format="%(created).3f %(process)d %(name)s %(message)s"
        )
    client_mode = config.get("client_mode", False)
    dht = DHT(
        initial_peers=initial_peers or None,
        start=True,
        client_mode=client_mode,
        host_maddrs=() if client_mode else LOCAL,
    )
    if events is not None:
        events.put(("maddrs", index, [str(a) for a in dht.get_visible_maddrs()], os.getpid()))
    inputs, targets = dataset()
    model = make_model(config.get("hidden", HIDDEN))
    batch = config.get("batch_size", 8)
    options = dict(config.get("options", {}))
    scheduler = None
    if config.get("scheduler"):
        scheduler = functools.partial(
            torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda epoch: 1.0 / (1 + epoch)
        )
    opt = Optimizer(
        dht=dht,
        run_id=config.get("run_id", "run"),
        target_batch_size=config["target_batch_size"],
        batch_size_per_step=None if config.get("auxiliary") else batch,
        optimizer=functools.partial(
            getattr(torch.optim, config.get("optimizer", "SGD")), lr=config.get("lr", 0.1)
        ),
        params=model.parameters(),
        scheduler=scheduler,
        matchmaking_time=config.get("matchmaking_time", 1.0),
        averaging_timeout=config.get("averaging_timeout", 30.0),
        tracker_opts=dict(FAST_TRACKER, **config.get("tracker_opts", {})),
        auxiliary=config.get("auxiliary", False),
        client_mode=client_mode,
        verbose=config.get("verbose", False),
        **options,
    )
    if config.get("runner") is not None:  # a faulty member's all-reduce (see tests/test_optimizer_attacks.py)
        opt.grad_averager.allreduce_runner = config["runner"]
    if barrier is not None:
        barrier.wait(60)
    generator = torch.Generator().manual_seed(100 + index)
    contributions: dict[int, list[int]] = {}
    pending: list[int] = []
    epoch_losses = {opt.local_epoch: full_loss(model, inputs, targets)}
    deadline = time.monotonic() + config.get("deadline", 90)
    grad_scaler, steps = None, 0
    if config.get("grad_scaler"):
        from plexus.optim.grad_scaler import GradScaler

        grad_scaler = GradScaler("cpu", init_scale=config["grad_scaler"])
    try:
        while (
            opt.local_epoch < config["epochs"]
            and time.monotonic() < deadline
            and not (stop is not None and stop.is_set())
        ):
            epoch, loads = opt.local_epoch, opt.state_loads
            if config.get("auxiliary"):
                opt.step()
                time.sleep(0.02)  # an auxiliary peer polls; it has no batches to pace it
            else:
                rows = torch.randint(0, NUM_SAMPLES, (batch,), generator=generator)
                loss = ((model(inputs[rows]) - targets[rows]) ** 2).mean()
                steps += 1
                if config.get("nan_every") and steps % config["nan_every"] == 0:
                    loss = loss * float("nan")  # a poisoned batch: every gradient of it is NaN
                if grad_scaler is not None:
                    grad_scaler.scale(loss).backward()
                    opt.step(grad_scaler=grad_scaler)
                    grad_scaler.update()
                else:
                    loss.backward()
                    if config.get("grad_scale") is not None:  # a member that flips or scales its gradients
                        for param in model.parameters():
                            param.grad.mul_(config["grad_scale"])
                    opt.step()
                if not options.get("reuse_grad_buffers"):
                    opt.zero_grad()
                pending.extend(rows.tolist())
                if config.get("step_delay"):
                    time.sleep(config["step_delay"])
            if opt.state_loads != loads:
                pending = []  # a download replaces the state: these batches never reached the swarm
            elif opt.local_epoch != epoch:
                contributions.setdefault(epoch, []).extend(pending)
                pending = []
            if opt.local_epoch != epoch:
                epoch_losses[opt.local_epoch] = full_loss(model, inputs, targets)
                if events is not None:
                    events.put(("epoch", index, opt.local_epoch))
    finally:
        opt.shutdown()
    lrs = [group["lr"] for group in opt.param_groups]
    outcome = dict(
        epoch=opt.local_epoch,
        params=[p.detach().clone().numpy() for p in model.parameters()],
        contributions=contributions,
        state_loads=opt.state_loads,
        rounds=opt.rounds_averaged,
        epoch_losses=epoch_losses,
        lrs=lrs,
        nonfinite_batches=opt.nonfinite_batches,
    )
    dht.shutdown()
    if isinstance(results, dict):
        results[index] = outcome
    elif results is not None:
        results.put(("done", index, outcome))


def replay(
    contributions_by_peer: list[dict[int, list[int]]],
    epochs: int,
    lr: float,
    drop_first_batch: bool = False,
    dtype=torch.float32,
):
    """One process, SGD on exactly the swarm's global batch of each epoch (all peers' contributions).

    Returns (parameters, full-data loss after each epoch)."""
    inputs, targets = dataset()
    model = make_model().to(dtype)
    inputs, targets = inputs.to(dtype), targets.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = {0: full_loss(model, inputs, targets)}
    for epoch in range(epochs):
        rows = [row for contributions in contributions_by_peer for row in contributions.get(epoch, [])]
        if drop_first_batch and epoch == 0:
            rows = rows[8:]
        assert rows, f"no peer contributed to epoch {epoch}"
        index = torch.tensor(rows)
        loss = ((model(inputs[index]) - targets[index]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses[epoch + 1] = full_loss(model, inputs, targets)
    return [p.detach().clone() for p in model.parameters()], losses


def start_threads(configs: list[dict], results: dict, events, barrier: bool = True, stop=None):
    """Run peers in threads of this process (cheaper than processes); peer 0 bootstraps the rest.

    Returns (threads, peer 0's multiaddrs)."""
    import queue
    import threading

    addresses = queue.Queue()
    sync = threading.Barrier(len(configs)) if barrier else None
    threads = [
        threading.Thread(
            target=run_peer,
            args=(i, config, addresses if i else None, results, sync, events),
            kwargs=dict(stop=stop),
            daemon=True,
        )
        for i, config in enumerate(configs)
    ]
    for thread in threads:
        thread.start()
    _kind, _, maddrs, _ = events.get(timeout=60)
    for _ in configs[1:]:
        addresses.put(maddrs)
    return threads, maddrs
