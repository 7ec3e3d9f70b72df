"""plexus.Optimizer: peers in one process (threads) train together and agree."""

import functools
import threading

import pytest
import torch

from plexus.dht.dht import DHT
from plexus.optim.optimizer import Optimizer

pytestmark = pytest.mark.timeout(120)
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
FAST_TRACKER = dict(min_refresh_period=0.05, max_refresh_period=2.0, default_refresh_period=0.2)


def train(dht: DHT, results: dict, index: int, epochs: int, **options) -> None:
    torch.manual_seed(0)  # every peer starts from the same model
    model = torch.nn.Linear(8, 1)
    generator = torch.Generator().manual_seed(index)
    inputs = torch.randn(256, 8, generator=generator)
    targets = inputs @ torch.arange(8.0).unsqueeze(1)
    opt = Optimizer(dht=dht, run_id="test_run", target_batch_size=64, batch_size_per_step=16,
                    optimizer=functools.partial(torch.optim.SGD, lr=0.05), params=model.parameters(),
                    matchmaking_time=1.0, averaging_timeout=10.0, tracker_opts=FAST_TRACKER, **options)
    losses = []
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


@pytest.mark.parametrize("options", [{}, dict(delay_optimizer_step=True, delay_grad_averaging=True)],
                         ids=["default", "delayed"])
def test_two_peers_train_together_and_end_identical(options):
    first = DHT(start=True, host_maddrs=LOCAL)
    second = DHT(initial_peers=first.get_visible_maddrs(), start=True, host_maddrs=LOCAL)
    results = {}
    threads = [threading.Thread(target=train, args=(dht, results, i, 6), kwargs=options)
               for i, dht in enumerate((first, second))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(100)
        assert set(results) == {0, 1}, "a peer did not finish"
        (epoch_a, params_a, losses_a), (epoch_b, params_b, losses_b) = results[0], results[1]
        assert min(epoch_a, epoch_b) >= 6
        assert sum(losses_a[-5:]) < sum(losses_a[:5]), "the loss goes down"
        if epoch_a == epoch_b and not options:  # without delays, both peers hold the same state
            for a, b in zip(params_a, params_b):
                assert torch.allclose(a, b, atol=1e-5)
    finally:
        second.shutdown()
        first.shutdown()


def test_bad_options_get_clear_errors():
    dht = DHT(start=True, host_maddrs=LOCAL)
    try:
        model = torch.nn.Linear(2, 1)
        with pytest.raises(ValueError, match="delay_optimizer_step requires offload_optimizer"):
            Optimizer(dht=dht, run_id="bad", target_batch_size=8, optimizer=torch.optim.SGD(model.parameters(), lr=1),
                      delay_optimizer_step=True)
        with pytest.raises(ValueError, match="either an optimizer instance"):
            Optimizer(dht=dht, run_id="bad", target_batch_size=8, optimizer=torch.optim.SGD(model.parameters(), lr=1),
                      params=model.parameters())
    finally:
        dht.shutdown()
