"""TrainingAverager (hivemind's legacy helper) and the periodic background averager, over real
DHT peers on 127.0.0.1."""

import logging
import threading

import pytest
import torch

from plexus.averaging.background import PeriodicAverager
from plexus.dht.dht import DHT
from plexus.optim import TrainingAverager

pytestmark = pytest.mark.timeout(60)
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
# request_timeout also bounds the DHT store of a matchmaking declaration: generous for loaded CI machines
FAST = dict(min_matchmaking_time=0.5, request_timeout=2.0)


def make_swarm(n: int) -> list[DHT]:
    first = DHT(start=True, host_maddrs=LOCAL)
    return [first] + [
        DHT(initial_peers=first.get_visible_maddrs(), start=True, host_maddrs=LOCAL) for _ in range(n - 1)
    ]


def close(*things) -> None:
    for thing in things:
        thing.shutdown()


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(5, 2)


def test_training_averager_averages_parameters_gradients_and_momentum_and_shares_state():
    dhts = make_swarm(3)
    models = [make_model(i) for i in range(2)]
    for i, model in enumerate(models):
        for param in model.parameters():
            param.grad = torch.full_like(param, float(i + 1))
    opts = [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) for model in models]
    for opt in opts:
        opt.step()  # momentum buffers now differ between the peers (grad 1 vs grad 2)
    params = [[p.detach().clone() for p in model.parameters()] for model in models]
    momenta = [
        [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
        for opt, model in zip(opts, models)
    ]
    averagers = [
        TrainingAverager(
            opt,
            dht=dht,
            average_parameters=True,
            average_gradients=True,
            average_opt_statistics=("momentum_buffer",),
            initialize_optimizer=False,
            prefix="legacy",
            target_group_size=2,
            start=True,
            **FAST,
        )
        for opt, dht in zip(opts, dhts)
    ]
    newcomer_model = make_model(5)
    newcomer = TrainingAverager(
        torch.optim.SGD(newcomer_model.parameters(), lr=0.1, momentum=0.9),
        dht=dhts[2],
        average_parameters=True,
        average_gradients=False,
        prefix="legacy",
        start=True,
        **FAST,
    )
    try:
        locks = [threading.Lock(), threading.Lock()]
        futures = [a.step(data_lock=lock, wait=False, timeout=20) for a, lock in zip(averagers, locks)]
        for future in futures:
            assert len(future.result(30)) == 2
        for model, averager, opt in zip(models, averagers, opts):
            assert averager.local_step == 1
            for param, a, b in zip(model.parameters(), *params):
                assert torch.allclose(param, (a + b) / 2, atol=1e-6)
                assert torch.allclose(param.grad, torch.full_like(param, 1.5))
            for param, a, b in zip(model.parameters(), *momenta):
                assert torch.allclose(opt.state[param]["momentum_buffer"], (a + b) / 2, atol=1e-6)

        assert newcomer.load_state_from_peers(timeout=20) is True
        for mine, theirs in zip(newcomer_model.parameters(), models[0].parameters()):
            assert torch.allclose(mine, theirs)
            assert torch.allclose(
                newcomer.opt.state[mine]["momentum_buffer"], opts[0].state[theirs]["momentum_buffer"]
            )
        assert newcomer.local_step == 1
    finally:
        close(newcomer, *averagers, *dhts)


def test_periodic_averager_pulls_two_models_together_each_period(caplog):
    dhts = make_swarm(2)
    models = [make_model(i) for i in range(2)]
    helpers = [
        PeriodicAverager(
            model,
            dht,
            prefix="periodic",
            averaging_period=1.0,
            wait_for_updates=True,
            step_timeout=10,
            target_group_size=2,
            **FAST,
        )
        for model, dht in zip(models, dhts)
    ]
    try:
        with caplog.at_level(logging.INFO, logger="plexus.averaging.background"):
            for round_number in (1, 2):
                before = [[p.detach().clone() for p in model.parameters()] for model in models]
                for helper in helpers:
                    helper.notify_update()
                for helper in helpers:
                    assert helper.wait_for_rounds(round_number, timeout=20)
                    assert helper.rounds_succeeded == round_number and helper.last_group_size == 2
                for model in models:
                    for param, a, b in zip(model.parameters(), *before):
                        assert torch.allclose(param, (a + b) / 2, atol=1e-6)
                with helpers[0].lock, torch.no_grad():  # the training loop moves one model away again
                    for param in models[0].parameters():
                        param.add_(1.0)
        messages = [record.getMessage() for record in caplog.records]
        assert messages.count("Starting a new averaging round with current parameters.") == 4
        assert (
            sum(m.startswith("Finished averaging round in") and m.endswith("with 2 peers.") for m in messages)
            == 4
        )
    finally:
        close(*helpers, *dhts)


def test_periodic_averager_alone_warns_and_keeps_its_parameters(caplog):
    dht = DHT(start=True, host_maddrs=LOCAL)
    model = make_model(0)
    before = [p.detach().clone() for p in model.parameters()]
    helper = PeriodicAverager(
        model,
        dht,
        prefix="alone",
        averaging_period=0.5,
        wait_for_updates=True,
        step_timeout=1.0,
        target_group_size=2,
        **FAST,
    )
    try:
        with caplog.at_level(logging.WARNING, logger="plexus.averaging.background"):
            helper.notify_update()
            assert helper.wait_for_rounds(1, timeout=20)
        assert helper.rounds_failed == 1 and helper.rounds_succeeded == 0
        assert any("could not find a group" in record.getMessage() for record in caplog.records)
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    finally:
        close(helper, dht)
