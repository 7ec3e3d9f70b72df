"""plexus.GradScaler on CPU: micro-batches leave gradients scaled, one real unscale and step per
global step, infs reset the accumulation and back the scale off, growth counts only real steps."""

import copy
import pickle

import pytest
import torch

from plexus.optim.grad_scaler import GradScaler

pytestmark = pytest.mark.timeout(30)


class Collaborative:
    """Stands in for plexus.Optimizer with reuse_grad_buffers: `.grad` accumulates over
    micro-batches and every `every`-th finite one ends a global step."""

    def __init__(self, params, every: int, lr: float = 0.5):
        self.inner = torch.optim.SGD(params, lr=lr)
        self.param_groups = self.inner.param_groups
        self.every, self.micro, self.global_steps, self.resets = every, 0, 0, 0
        self.seen_in_global_step = None

    def step(self, grad_scaler=None):
        if not grad_scaler.are_grads_finite(self, use_cached=True):
            self.resets += 1
            self.micro = 0
            self.inner.zero_grad()
            return
        self.micro += 1
        if self.micro < self.every:
            return
        with grad_scaler.running_global_step():
            assert grad_scaler.unscale_(self)  # before averaging, as the Optimizer does
        self.seen_in_global_step = [p.grad.clone() for p in self.inner.param_groups[0]["params"]]  # averaging
        with grad_scaler.running_global_step():
            grad_scaler.step(self.inner)
        self.global_steps += 1
        self.micro = 0
        self.inner.zero_grad()


def micro_batch(scaler, weight, x, poison=False):
    loss = (weight.float() * x).sum()
    scaler.scale(loss).backward()
    if poison:
        weight.grad[0] = float("inf")


def test_micro_batches_stay_scaled_and_the_global_step_unscales_once():
    weight = torch.nn.Parameter(torch.zeros(4))
    opt = Collaborative([weight], every=3)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    xs = [torch.tensor([1.0, 2.0, 3.0, 4.0]) * (k + 1) for k in range(3)]
    for k, x in enumerate(xs[:2]):
        micro_batch(scaler, weight, x)
        assert scaler.unscale_(opt) is False, "between global steps unscale_ only checks"
        scaler.step(opt)
        assert scaler.update() is False
        assert scaler.get_scale() == 2.0**10, "no growth without a real step"
        assert torch.equal(weight.grad, 2.0**10 * sum(xs[: k + 1])), (
            "gradients stay scaled while accumulating"
        )
        assert torch.equal(weight, torch.zeros(4))
    micro_batch(scaler, weight, xs[2])
    scaler.step(opt)
    assert scaler.update() is True
    assert opt.global_steps == 1
    assert torch.equal(opt.seen_in_global_step[0], sum(xs)), "unscaled exactly once"
    assert torch.allclose(weight.detach(), -0.5 * sum(xs)), "the inner step used the unscaled sum"
    assert scaler.get_scale() == 2.0**11, "a real step counts towards growth"


def test_infs_reset_the_accumulation_and_back_off_at_once():
    weight = torch.nn.Parameter(torch.zeros(3))
    opt = Collaborative([weight], every=2)
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    x = torch.ones(3)
    micro_batch(scaler, weight, x)
    scaler.step(opt)
    scaler.update()
    micro_batch(scaler, weight, x, poison=True)
    scaler.step(opt)
    assert scaler.update() is False
    assert opt.resets == 1 and opt.global_steps == 0, "the poisoned batch ended nothing"
    assert scaler.get_scale() == 2.0**7, "backed off right away"
    assert torch.equal(weight, torch.zeros(3))
    for _ in range(4):  # two clean global steps: growth_interval=2 real steps, then growth
        micro_batch(scaler, weight, x)
        scaler.step(opt)
        scaler.update()
    assert opt.global_steps == 2
    assert scaler.get_scale() == 2.0**8
    assert torch.allclose(weight.detach(), torch.full((3,), -0.5 * 2 * 2)), "two steps, each on two grads"


def test_infs_found_in_the_global_step_skip_it():
    weight = torch.nn.Parameter(torch.zeros(2))
    opt = Collaborative([weight], every=1)
    scaler = GradScaler("cpu", init_scale=4.0, growth_interval=1)
    micro_batch(scaler, weight, torch.ones(2))
    # overflow that appears only once unscaled-and-averaged: poison between the check and the step
    scaler.are_grads_finite(opt)
    weight.grad[1] = float("nan")
    scaler.step(opt)
    assert scaler.update() is True
    assert torch.equal(weight, torch.zeros(2)), "torch's step skipped the non-finite update"
    assert scaler.get_scale() == 2.0


def test_fp16_gradients_can_be_unscaled():
    weight = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    opt = Collaborative([weight], every=1, lr=1.0)
    scaler = GradScaler("cpu", init_scale=2.0**4, growth_interval=100)
    micro_batch(scaler, weight, torch.full((4,), 0.25))
    assert weight.grad.dtype == torch.float16
    scaler.step(opt)
    scaler.update()
    assert torch.equal(weight.detach(), torch.full((4,), -0.25, dtype=torch.float16))


def test_plain_optimizers_are_refused_between_global_steps():
    weight = torch.nn.Parameter(torch.zeros(2))
    scaler = GradScaler("cpu")
    micro_batch(scaler, weight, torch.ones(2))
    with pytest.raises(TypeError, match="plexus.Optimizer"):
        scaler.step(torch.optim.SGD([weight], lr=0.1))


def test_disabled_scaler_passes_through():
    weight = torch.nn.Parameter(torch.zeros(2))
    scaler = GradScaler("cpu", enabled=False)
    loss = scaler.scale((weight * torch.ones(2)).sum())
    loss.backward()
    scaler.step(torch.optim.SGD([weight], lr=1.0))
    assert scaler.update() is False
    assert torch.equal(weight.detach(), -torch.ones(2))


def test_scaler_pickles_and_copies():
    scaler = GradScaler("cpu", init_scale=8.0)
    clone = pickle.loads(pickle.dumps(scaler))
    assert copy.deepcopy(scaler).get_scale() == clone.get_scale() == 8.0
    weight = torch.nn.Parameter(torch.zeros(2))
    opt = Collaborative([weight], every=1)
    micro_batch(clone, weight, torch.ones(2))
    clone.step(opt)
    assert clone.update() is True
