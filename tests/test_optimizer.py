"""plexus.Optimizer: peers in one process (threads) train together and agree; logs; shutdown."""

import functools
import logging
import re
import threading

import pytest
import torch

from plexus.dht.dht import DHT
from plexus.optim.optimizer import Optimizer

pytestmark = pytest.mark.timeout(120)
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
FAST_TRACKER = dict(min_refresh_period=0.05, max_refresh_period=2.0, default_refresh_period=0.2)


def train(dht: DHT, results: dict, index: int, epochs: int, barrier: threading.Barrier, **options) -> None:
    torch.manual_seed(0)  # every peer starts from the same model
    model = torch.nn.Linear(8, 1)
    generator = torch.Generator().manual_seed(index)
    inputs = torch.randn(256, 8, generator=generator)
    targets = inputs @ torch.arange(8.0).unsqueeze(1)
    opt = Optimizer(
        dht=dht,
        run_id="test_run",
        target_batch_size=64,
        batch_size_per_step=16,
        optimizer=functools.partial(torch.optim.SGD, lr=0.05),
        params=model.parameters(),
        matchmaking_time=1.0,
        averaging_timeout=10.0,
        tracker_opts=FAST_TRACKER,
        verbose=True,
        **options,
    )
    losses = []
    barrier.wait(30)  # "start together": both constructed (and announced) before either trains
    try:
        while opt.local_epoch < epochs:
            rows = torch.randint(0, 256, (16,), generator=generator)
            loss = ((model(inputs[rows]) - targets[rows]) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        opt.shutdown()  # waits for background rounds and applies them
    results[index] = (opt.local_epoch, [p.detach().clone() for p in model.parameters()], losses)


@pytest.mark.parametrize(
    "options", [{}, dict(delay_optimizer_step=True, delay_grad_averaging=True)], ids=["default", "delayed"]
)
def test_two_peers_train_together_and_end_identical(options, caplog):
    caplog.set_level(logging.INFO, logger="plexus.optim")
    first = DHT(start=True, host_maddrs=LOCAL)
    second = DHT(initial_peers=first.get_visible_maddrs(), start=True, host_maddrs=LOCAL)
    results, barrier = {}, threading.Barrier(2)
    threads = [
        threading.Thread(target=train, args=(dht, results, i, 6, barrier), kwargs=options)
        for i, dht in enumerate((first, second))
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(100)
        assert set(results) == {0, 1}, "a peer did not finish"
        (epoch_a, params_a, losses_a), (epoch_b, params_b, _losses_b) = results[0], results[1]
        assert min(epoch_a, epoch_b) >= 6
        assert sum(losses_a[-5:]) < sum(losses_a[:5]), "the loss goes down"
        assert epoch_a == epoch_b == 6, "peers that start together share every epoch"
        for a, b in zip(params_a, params_b):
            assert torch.allclose(a, b, atol=1e-6)
        # the status lines of the tutorial, at INFO with verbose=True
        text = caplog.text
        assert re.search(
            r"test_run accumulated \d+ samples for epoch #\d+ from 2 peers\. "
            r"ETA \d+\.\d\d sec \(refresh in \d+\.\d\d sec\)",
            text,
        )
        for line in (
            r"Step #6",
            r"Your current contribution: \d+ samples",
            r"Performance: [\d.]+ samples/sec",
            r"Local loss: [\d.]+",
            r"Averaged gradients with 2 peers",
            r"Averaged parameters with 2 peers",
        ):
            if line.startswith("Local loss"):
                continue  # this loop calls backward() itself: the optimizer never sees the loss
            assert re.search(line, text), f"no log line like {line!r}"
    finally:
        second.shutdown()
        first.shutdown()


def test_bad_options_get_clear_errors():
    dht = DHT(start=True, host_maddrs=LOCAL)
    try:
        model = torch.nn.Linear(2, 1)
        with pytest.raises(ValueError, match="delay_optimizer_step requires offload_optimizer"):
            Optimizer(
                dht=dht,
                run_id="bad",
                target_batch_size=8,
                optimizer=torch.optim.SGD(model.parameters(), lr=1),
                delay_optimizer_step=True,
            )
        with pytest.raises(ValueError, match="either an optimizer instance"):
            Optimizer(
                dht=dht,
                run_id="bad",
                target_batch_size=8,
                optimizer=torch.optim.SGD(model.parameters(), lr=1),
                params=model.parameters(),
            )
    finally:
        dht.shutdown()


@pytest.mark.timeout(60)
def test_shutdown_is_quick_when_no_round_runs():
    dht = DHT(start=True, host_maddrs=LOCAL)
    try:
        model = torch.nn.Linear(4, 1)
        opt = Optimizer(
            dht=dht,
            run_id="alone",
            target_batch_size=10**6,
            batch_size_per_step=4,
            optimizer=functools.partial(torch.optim.SGD, lr=0.1),
            params=model.parameters(),
            tracker_opts=FAST_TRACKER,
        )
        for _ in range(5):
            model(torch.randn(4, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        opt.shutdown()
        assert dht.get("alone_progress", latest=True).value[opt.tracker._subkey].value is None, "said goodbye"
    finally:
        dht.shutdown()
