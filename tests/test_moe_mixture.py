"""Mixtures of remote experts: the quorum rules, exact gradients, dead and slow experts, timeouts, Switch."""

import asyncio
import itertools
import threading
import time

import pytest
import torch
from torch import nn

from plexus.dht.dht import DHT
from plexus.moe import (
    BatchTensorDescriptor,
    ModuleBackend,
    RemoteMixtureOfExperts,
    RemoteSwitchMixtureOfExperts,
    Server,
    TooFewExpertsError,
)
from plexus.moe.client import MoEBeamSearcher
from plexus.moe.client.quorum import Quorum, call_with_quorum

pytestmark = pytest.mark.timeout(30)
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
HIDDEN = 8


# --- the quorum rules, without a network ----------------------------------------------------------


def test_quorum_bookkeeping():
    quorum = Quorum(3, rows=[[0, 1], [1, 2], [2]], k_min=1)
    assert not quorum.reached and quorum.hopeless() == []
    quorum.failed(0)
    assert quorum.hopeless() == [0], "sample 0 had only call 0"
    quorum.succeeded(1)
    assert quorum.answers == [0, 1, 1] and not quorum.reached
    assert Quorum(2, rows=[], k_min=0).reached


def run_quorum(outcomes, rows, num_samples, k_min, after=None, deadline_in=5.0):
    """outcomes[i]: a value (answers at once), an exception (fails at once) or None (never answers)."""
    hang = asyncio.Event()
    started = []

    def make(i, outcome):
        async def call():
            started.append(i)
            if outcome is None:
                await hang.wait()
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        return call

    async def main():
        return await call_with_quorum(
            [make(i, o) for i, o in enumerate(outcomes)],
            rows,
            num_samples,
            k_min,
            after,
            time.monotonic() + deadline_in,
            lambda i: f"call {i}",
            "forward",
        )

    begin = time.monotonic()
    result = asyncio.run(main())
    return result, time.monotonic() - begin


def test_stragglers_are_cancelled_once_k_min_answered_and_timeout_after_k_min_passed():
    result, elapsed = run_quorum(
        ["a", None, "c"], rows=[[0], [0, 1], [1]], num_samples=2, k_min=1, after=0.05
    )
    assert result == {0: "a", 2: "c"} and elapsed < 4


def test_too_few_answers_fail_early_and_name_the_failures():
    with pytest.raises(
        TooFewExpertsError, match=r"forward: 1 of 2 samples.*call 1: ConnectionRefusedError: gone"
    ):
        run_quorum(["a", ConnectionRefusedError("gone"), None], rows=[[0], [1], [0]], num_samples=2, k_min=1)
    with pytest.raises(TimeoutError, match="unanswered at the deadline"):
        run_quorum([None], rows=[[0]], num_samples=1, k_min=1, deadline_in=0.1)
    result, _ = run_quorum([ValueError("x")], rows=[[0]], num_samples=1, k_min=0)
    assert result == {}


# --- servers --------------------------------------------------------------------------------------


def ffn(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.Tanh(), nn.Linear(2 * HIDDEN, HIDDEN))


def start_server(modules: dict, initial_peers=()) -> Server:
    """A server of the given modules (no optimizer: they stay equal to the local copies)."""
    dht = DHT(initial_peers=initial_peers, start=True, host_maddrs=LOCAL)
    descriptor = BatchTensorDescriptor((HIDDEN,), requires_grad=True)
    backends = {
        uid: ModuleBackend(uid, module, args_schema=(descriptor,), outputs_schema=descriptor)
        for uid, module in modules.items()
    }
    server = Server(dht, backends, start=True)
    server._owns_dht = True
    return server


@pytest.fixture(scope="module")
def swarm():
    """Grid 'mix' (2 x 3) split over two servers: row 0 on `alive`, row 1 on `doomed` (tests may kill it)."""
    modules = {f"mix.{i}.{j}": ffn(3 * i + j) for i, j in itertools.product(range(2), range(3))}
    alive = start_server({uid: m for uid, m in modules.items() if uid.startswith("mix.0.")})
    doomed = start_server(
        {uid: m for uid, m in modules.items() if uid.startswith("mix.1.")}, alive.dht.get_visible_maddrs()
    )
    client = DHT(initial_peers=alive.dht.get_visible_maddrs(), start=True, client_mode=True)
    yield dict(modules=modules, alive=alive, doomed=doomed, client=client)
    client.shutdown()
    doomed.shutdown()
    alive.shutdown()


def local_mixture(moe, x, modules, usable):
    """The same mixture computed in-process: brute-force top-k over `usable` experts, softmax over them."""
    scores = moe.proj(x).split(moe.grid_size, dim=-1)
    outputs = []
    for b in range(x.shape[0]):

        def score(uid):
            return sum(s[b, int(c)] for s, c in zip(scores, uid.split(".")[1:]))

        ranked = sorted(modules, key=lambda uid: -float(score(uid).detach()))[: moe.k_best]
        chosen = [uid for uid in ranked if uid in usable]
        weights = torch.softmax(torch.stack([score(uid) for uid in chosen]), dim=0)
        outputs.append(sum(w * modules[uid](x[b : b + 1])[0] for w, uid in zip(weights, chosen)))
    return torch.stack(outputs)


def compare_with_local(moe, modules, usable, seed):
    moe.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    x = torch.randn(5, HIDDEN, requires_grad=True)
    weights = torch.randn(5, HIDDEN)
    remote = moe(x)
    (remote * weights).sum().backward()
    remote_grads = x.grad.clone(), moe.proj.weight.grad.clone()
    x.grad, moe.proj.weight.grad = None, None
    local = local_mixture(moe, x, modules, usable)
    (local * weights).sum().backward()
    torch.testing.assert_close(remote, local, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(remote_grads[0], x.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(remote_grads[1], moe.proj.weight.grad, rtol=1e-4, atol=1e-5)


def test_mixture_outputs_and_gradients_equal_the_same_modules_run_locally(swarm):
    moe = RemoteMixtureOfExperts(
        in_features=HIDDEN,
        grid_size=(2, 3),
        dht=swarm["client"],
        uid_prefix="mix",
        k_best=3,
        forward_timeout=10,
        backward_timeout=10,
    )
    compare_with_local(moe, swarm["modules"], set(swarm["modules"]), seed=0)
    assert moe.info["outputs_schema"].shape == (HIDDEN,)


def test_forward_timeout_covers_the_beam_search(swarm, monkeypatch):
    async def stuck(self, node, prefixes):
        await asyncio.Event().wait()

    monkeypatch.setattr(MoEBeamSearcher, "fetch_successors", stuck)
    moe = RemoteMixtureOfExperts(
        in_features=HIDDEN,
        grid_size=(2, 3),
        dht=swarm["client"],
        uid_prefix="mix",
        k_best=2,
        forward_timeout=0.3,
    )
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="forward_timeout of 0.3 s passed during beam search"):
        moe(torch.randn(2, HIDDEN))
    assert time.monotonic() - started < 5


def test_anomalies_misshapen_inputs_and_empty_grids_are_refused_before_sending(swarm):
    moe = RemoteMixtureOfExperts(
        in_features=HIDDEN,
        grid_size=(2, 3),
        dht=swarm["client"],
        uid_prefix="mix",
        k_best=2,
        detect_anomalies=True,
    )
    x = torch.randn(2, HIDDEN)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        moe(x)
    sparse = RemoteMixtureOfExperts(
        in_features=HIDDEN, grid_size=(3, 3), dht=swarm["client"], uid_prefix="nobody", k_best=2
    )
    with pytest.raises(TooFewExpertsError, match="beam search found only 0 experts under 'nobody.'"):
        sparse(torch.randn(2, HIDDEN))
    with pytest.raises(
        ValueError, match=r"input 0 of the mixture has shape \(2, 3, 8\), expected \(batch, 8\)"
    ):
        moe(
            torch.randn(2, 3, HIDDEN)
        )  # the gate would average the middle dimension, but these experts refuse it


def test_slow_experts_are_left_behind_after_timeout_after_k_min(swarm):
    release = threading.Event()

    class Blocked(nn.Module):
        def forward(self, x):
            release.wait(20)
            return x

    slow = start_server({"lag.0.1": Blocked()}, swarm["alive"].dht.get_visible_maddrs())
    fast = start_server({"lag.0.0": nn.Identity()}, swarm["alive"].dht.get_visible_maddrs())
    try:
        moe = RemoteMixtureOfExperts(
            in_features=HIDDEN,
            grid_size=(1, 2),
            dht=swarm["client"],
            uid_prefix="lag",
            k_best=2,
            k_min=1,
            timeout_after_k_min=0.1,
            forward_timeout=15,
        )
        x = torch.randn(3, HIDDEN)
        started = time.monotonic()
        torch.testing.assert_close(moe(x), x)  # only the identity answered, with all the weight
        assert time.monotonic() - started < 10, "the blocked expert must not be waited for"
        moe.k_min = 2
        # the call's own timeout and the forward's deadline are the same instant: either reports it
        with pytest.raises(TooFewExpertsError, match="unanswered at the deadline|lag.0.1 on .*TimeoutError"):
            moe.forward_timeout = 0.5
            moe(x)
    finally:
        release.set()
        slow.shutdown()
        fast.shutdown()


def test_switch_mixture_routes_balances_and_keeps_the_residual(swarm):
    moe = RemoteSwitchMixtureOfExperts(
        in_features=HIDDEN,
        grid_size=(2, 3),
        dht=swarm["client"],
        uid_prefix="mix",
        forward_timeout=10,
        jitter_eps=0.0,
    )
    x = torch.randn(6, HIDDEN, requires_grad=True)
    moe.eval()
    _, balancing_loss = moe(x)
    assert float(balancing_loss.detach()) == pytest.approx(2.0, abs=1e-4), (
        "uniform utilisation gives 1 per dimension"
    )
    moe.train()
    output, balancing_loss = moe(x)
    assert output.shape == x.shape and torch.isfinite(output).all() and float(balancing_loss.detach()) > 2.0
    (output.sum() + balancing_loss).backward()
    assert moe.proj.weight.grad.abs().sum() > 0 and x.grad is not None
    for utilization in moe.grid_utilization:
        assert float(utilization.sum()) == pytest.approx(1.0)
    # the expert output is the winner's, scaled by its probability, plus the input
    with torch.no_grad():
        probs = [torch.softmax(s, -1) for s in moe.proj(x).split(moe.grid_size, -1)]
        i, j = int(probs[0][0].argmax()), int(probs[1][0].argmax())
        expected = probs[0][0, i] * probs[1][0, j] * swarm["modules"][f"mix.{i}.{j}"](x[:1])[0] + x[0]
    torch.testing.assert_close(output[0].detach(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(40)
def test_mixture_survives_dead_experts_down_to_k_min_and_fails_clearly_below(swarm):
    """Runs last: it kills the `doomed` server (its announcements outlive it, so calls to it fail)."""
    client, modules = swarm["client"], swarm["modules"]
    moe = RemoteMixtureOfExperts(
        in_features=HIDDEN,
        grid_size=(2, 3),
        dht=client,
        uid_prefix="mix",
        k_best=6,
        k_min=1,
        forward_timeout=10,
        backward_timeout=10,
    )
    x = torch.randn(4, HIDDEN, requires_grad=True)
    before = moe(x)  # everyone alive for the forward pass ...
    swarm["doomed"].shutdown()
    before.sum().backward()  # ... and half of them dead for the backward (backward_k_min=1 still holds)
    assert torch.isfinite(x.grad).all()

    row0 = {uid for uid in modules if uid.startswith("mix.0.")}
    compare_with_local(moe, modules, row0, seed=1)

    moe.k_min = 4
    started = time.monotonic()
    with pytest.raises(TooFewExpertsError, match=r"forward: 4 of 4 samples .* expert mix\.1\.\d on"):
        moe(x)
    assert time.monotonic() - started < 8, "a certain failure must not wait for forward_timeout"

    switch = RemoteSwitchMixtureOfExperts(
        in_features=HIDDEN, grid_size=(2, 3), dht=client, uid_prefix="mix", forward_timeout=10
    )
    switch.eval()
    with torch.no_grad():  # route every sample to row 0 once (the layer learns the experts' schema) ...
        switch.proj.weight.zero_()
        switch.proj.bias.copy_(torch.tensor([5.0, -5.0, 0.0, 0.0, 0.0]))
        switch(x)
        switch.proj.bias.copy_(torch.tensor([-5.0, 5.0, 0.0, 0.0, 0.0]))  # ... then to row 1, all dead
    output, _ = switch(x)
    torch.testing.assert_close(output, x)  # allow_zero_outputs: zeros from the experts, plus the residual
