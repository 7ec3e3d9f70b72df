"""plexus.Optimizer in swarms: late joiners, a SIGKILLed peer, client and auxiliary peers, each
delay/offload option, the GradScaler on CPU, and failed averaging.

Peers run in threads of this process (each with its own DHT and host) except where a process is
the point (SIGKILL). Timing bounds are generous: the machine is shared and loaded.
"""

import logging
import multiprocessing
import os
import queue
import signal
import threading
import time

import numpy as np
import psutil
import pytest

from tests.test_optimizer_peer import run_peer, start_threads

pytestmark = pytest.mark.timeout(120)


def join(threads, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "a peer did not finish"


def wait_for_epoch(events, peer: int, epoch: int, timeout: float = 60) -> float:
    """Block until `peer` reports `epoch` (or later); returns when (time.monotonic())."""
    deadline = time.monotonic() + timeout
    while True:
        kind, index, value, *_ = events.get(timeout=max(0.01, deadline - time.monotonic()))
        if kind == "epoch" and index == peer and value >= epoch:
            return time.monotonic()


def same_params(a: dict, b: dict, atol: float = 0.0) -> bool:
    return all(np.allclose(x, y, atol=atol, rtol=0) for x, y in zip(a["params"], b["params"]))


def test_late_joiner_catches_up_with_epoch_parameters_and_learning_rate():
    config = dict(target_batch_size=128, epochs=8, step_delay=0.01, scheduler=True)
    results, events = {}, queue.Queue()
    threads, maddrs = start_threads([config, config], results, events)
    wait_for_epoch(events, 0, 2)
    late = threading.Thread(target=run_peer, args=(2, config, maddrs, results), daemon=True)
    late.start()
    join([*threads, late])

    newcomer = results[2]
    assert newcomer["state_loads"] >= 1, "the late peer downloaded the state"
    assert min(newcomer["contributions"], default=2) >= 2, "it never trained on epochs the swarm had finished"
    assert [results[i]["epoch"] for i in range(3)] == [8, 8, 8]
    assert same_params(results[0], results[2], atol=1e-6) and same_params(results[0], results[1], atol=1e-6)
    for outcome in results.values():  # LambdaLR(1 / (1 + epoch)) caught up with the epoch it loaded
        assert outcome["lrs"] == pytest.approx([0.1 / (1 + 8)])


def test_client_mode_and_auxiliary_peers_train_with_the_swarm():
    trainer = dict(target_batch_size=128, epochs=4, step_delay=0.005, averaging_timeout=10.0)
    configs = [trainer, dict(trainer, client_mode=True), dict(trainer, auxiliary=True, epochs=10**6)]
    results, events, stop = {}, queue.Queue(), threading.Event()
    threads, _ = start_threads(configs, results, events, stop=stop)
    join(threads[:2])
    stop.set()
    join(threads[2:], 30)
    normal, client, helper = results[0], results[1], results[2]
    assert normal["epoch"] == client["epoch"] == 4
    assert same_params(normal, client, atol=1e-6)
    assert normal["rounds"] >= 3 and client["rounds"] >= 3, "the client-mode peer averaged through the other"
    assert helper["rounds"] >= 1 and helper["epoch"] >= 3, (
        "the auxiliary peer joined rounds and followed epochs"
    )
    assert not any(helper["contributions"].values()), "it took no batches"


@pytest.mark.parametrize(
    "options",
    [
        dict(offload_optimizer=False),
        dict(delay_optimizer_step=True),
        dict(delay_optimizer_step=True, delay_grad_averaging=True),
        dict(reuse_grad_buffers=True),
        dict(delay_state_averaging=False, average_state_every=2),
        dict(use_local_updates=True),
    ],
    ids=[
        "no-offload",
        "delay-step",
        "delay-step-and-grads",
        "reuse-grad-buffers",
        "sync-state-every-2",
        "local-updates",
    ],
)
def test_each_update_option_trains_and_keeps_peers_together(options):
    config = dict(target_batch_size=64, epochs=4, options=options, optimizer="Adam", lr=0.01)
    results, events = {}, queue.Queue()
    threads, _ = start_threads([config, config], results, events)
    join(threads)
    first, second = results[0], results[1]
    assert first["epoch"] == second["epoch"] == 4
    assert first["epoch_losses"][4] < first["epoch_losses"][0], "the loss goes down"
    if options.get("use_local_updates"):
        assert first["rounds"] == 0  # no gradient rounds: each peer steps on its own batches
    else:
        assert first["rounds"] >= 2 and second["rounds"] >= 2
        assert same_params(first, second, atol=1e-6), "peers that averaged every epoch hold the same model"


def test_grad_scaler_on_cpu():
    config = dict(target_batch_size=64, epochs=3, grad_scaler=2.0**10, options=dict(reuse_grad_buffers=True))
    results, events = {}, queue.Queue()
    threads, _ = start_threads([config, config], results, events)
    join(threads)
    assert results[0]["epoch"] == results[1]["epoch"] == 3
    assert results[0]["epoch_losses"][3] < results[0]["epoch_losses"][0]
    assert same_params(results[0], results[1], atol=1e-6)


def test_failed_averaging_proceeds_with_local_gradients_and_says_so(caplog):
    """Two peers whose models differ find each other in the tracker but can never average."""
    caplog.set_level(logging.DEBUG, logger="plexus.optim.optimizer")
    config = dict(target_batch_size=64, epochs=2, matchmaking_time=0.5, averaging_timeout=2.0)
    results, events = {}, queue.Queue()
    threads, _ = start_threads([config, dict(config, hidden=8)], results, events)
    join(threads)
    assert results[0]["epoch"] == results[1]["epoch"] == 2
    assert results[0]["rounds"] == results[1]["rounds"] == 0
    assert "Proceeding with local gradients" in caplog.text


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigkilled_peer_stalls_nobody_and_leaves_nothing_behind():
    config = dict(
        target_batch_size=128,
        epochs=10**6,
        step_delay=0.01,
        deadline=120,
        matchmaking_time=1.0,
        averaging_timeout=10.0,
    )
    context = multiprocessing.get_context("spawn")
    results, events, addresses = context.Queue(), context.Queue(), context.Queue()
    processes = [
        context.Process(
            target=run_peer, args=(i, config, addresses if i else None, results, None, events), daemon=True
        )
        for i in range(3)
    ]
    for process in processes:
        process.start()
    try:
        _kind, _, maddrs, _ = events.get(timeout=90)
        for _ in range(2):
            addresses.put(maddrs)
        victim = processes[2]
        wait_for_epoch(events, 2, 2, timeout=90)  # all three train together
        assert psutil.Process(victim.pid).children(recursive=True) == [], "a peer is one process, no helpers"
        start = wait_for_epoch(events, 0, 3)
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        victim.join(10)
        assert (
            not psutil.pid_exists(victim.pid) or psutil.Process(victim.pid).status() == psutil.STATUS_ZOMBIE
        )
        # survivors go on: the dead peer's record goes stale within 3 refresh periods (3 s), and a
        # round it was in fails within its sender timeout; bound: twice that, plus two epochs
        epoch_time = killed_at - start
        reached = wait_for_epoch(events, 0, 6, timeout=60)
        assert reached - killed_at < 2 * (3.0 + 2 * config["matchmaking_time"]) + 3 * max(epoch_time, 1.0)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(10)
