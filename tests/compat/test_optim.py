"""hivemind's optimizer and averager options: grad_averager_factory, fresh state downloads, and
averager configurations hivemind accepts."""

import functools
import logging

import pytest
import torch
from hivemind import Optimizer
from hivemind.averaging import DecentralizedAverager
from hivemind.optim.grad_averager import GradientAverager, GradientAveragerFactory
from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager

pytestmark = pytest.mark.timeout(60)


def test_grad_averager_factory_builds_the_optimizers_gradient_averager(dht_pair):
    model = torch.nn.Linear(8, 8)
    built = []

    def factory(*args, **kwargs) -> GradientAverager:
        averager = PowerSGDGradientAverager(*args, averager_rank=2, **kwargs)
        built.append(averager)
        return averager

    choose: GradientAveragerFactory = factory
    opt = Optimizer(
        dht=dht_pair[0],
        run_id="factory_run",
        target_batch_size=8,
        batch_size_per_step=4,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        params=model.parameters(),
        grad_averager_factory=choose,
    )
    try:
        assert built and opt.grad_averager is built[0]
        assert isinstance(opt.grad_averager, PowerSGDGradientAverager)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        assert opt.tracker.global_epoch == opt.local_epoch and opt.tracker.is_alive()
        assert opt.scheduled_grads is None or not opt.scheduled_grads.done()
    finally:
        opt.shutdown()
    assert not opt.tracker.is_alive()


def test_each_download_gets_the_donors_current_state(dht_pair):
    calls = []
    metadata, tensors = {"x": 123}, (torch.randn(3), torch.randint(0, 5, (3,)))

    class Donor(DecentralizedAverager):
        def get_current_state(self):
            calls.append(1)
            return metadata, tensors

    donor = Donor([torch.randn(3)], dht=dht_pair[0], prefix="fresh", target_group_size=2, start=True)
    newcomer = Donor([torch.randn(3)], dht=dht_pair[1], prefix="fresh", target_group_size=2, start=True)
    try:
        got_metadata, got = newcomer.load_state_from_peers()
        assert got_metadata == metadata and all(map(torch.equal, got, tensors)) and len(calls) == 1
        metadata["y"] = 1  # the donor's state moves on right after the first download
        tensors[1][2] = 9
        got_metadata, got = newcomer.load_state_from_peers()
        assert got_metadata == metadata and all(map(torch.equal, got, tensors)) and len(calls) == 2
        donor.allow_state_sharing = False
        assert newcomer.load_state_from_peers(timeout=5) is None
    finally:
        newcomer.shutdown()
        donor.shutdown()


def test_min_group_size_above_the_target_warns_instead_of_refusing(dht_pair, caplog):
    with caplog.at_level(logging.WARNING):
        averager = DecentralizedAverager(
            [torch.zeros(2)],
            dht=dht_pair[0],
            prefix="lenient",
            target_group_size=2,
            min_group_size=4,
            start=True,
        )
    try:
        assert averager.min_group_size == 2 and "min_group_size=4 exceeds target_group_size=2" in caplog.text
    finally:
        averager.shutdown()
