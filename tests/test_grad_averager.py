"""GradientAverager and PowerSGDGradientAverager over real DHT peers on 127.0.0.1.

One swarm of four DHT peers serves the whole module; every test meets under its own prefix.
"""

import time

import pytest
import torch

from plexus.averaging.averager import AveragingError
from plexus.averaging.control import AveragingStage
from plexus.dht.dht import DHT
from plexus.optim.grad_averager import GradientAverager
from plexus.optim.power_sgd_averager import PowerSGDGradientAverager, matrix_shape, orthogonalize_

pytestmark = pytest.mark.timeout(60)
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
FAST = dict(min_matchmaking_time=1.0, request_timeout=0.5, start=True)


@pytest.fixture(scope="module")
def swarm():
    first = DHT(start=True, host_maddrs=LOCAL)
    dhts = [first] + [
        DHT(initial_peers=first.get_visible_maddrs(), start=True, host_maddrs=LOCAL) for _ in range(3)
    ]
    yield dhts
    for dht in dhts:
        dht.shutdown()


def make_params(seed: int = 0, dtype=torch.float32) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype))
        for shape in [(5, 3), (3,), (2, 2, 2)]
    ]


def set_grads(params, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + seed)
    grads = [torch.randn(p.shape, generator=generator).to(p.dtype) for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return grads


def averaged(averager) -> list[torch.Tensor]:
    with averager.use_averaged_gradients():
        return [p.grad.detach().clone() for p in averager.parameters]


def shutdown(*averagers) -> None:
    for averager in averagers:
        averager.shutdown()


@pytest.mark.parametrize("n, samples", [(2, [8, 8]), (3, [1, 5, 10]), (4, [3, 3, 3, 3])])
def test_sample_weighted_mean(swarm, n, samples):
    peers = [make_params(i) for i in range(n)]
    averagers = [
        GradientAverager(params, dht=dht, prefix=f"mean{n}", target_group_size=n, **FAST)
        for params, dht in zip(peers, swarm)
    ]
    try:
        local = []
        for i, (params, averager) in enumerate(zip(peers, averagers)):
            local.append(set_grads(params, i))
            averager.accumulate_grads_(samples[i])
            assert averager.local_samples_accumulated == samples[i] and averager.local_times_accumulated == 1
        controls = [averager.step(wait=False, timeout=20) for averager in averagers]
        for control in controls:
            assert len(control.result()) == n
        expected = [sum(s * g[k].double() for s, g in zip(samples, local)) / sum(samples) for k in range(3)]
        for averager in averagers:
            assert averager.local_samples_accumulated == 0, "accumulators reset after the step"
            for got, want in zip(averaged(averager), expected):
                assert torch.allclose(got.double(), want, atol=1e-6)
        for params, grads in zip(peers, local):  # the block restores the local .grad
            assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
    finally:
        shutdown(*averagers)


def test_accumulation_over_unequal_micro_batches_into_given_buffers(swarm):
    peers = [make_params(i) for i in range(2)]
    buffers = [torch.zeros(p.shape) for p in peers[0]]
    a = GradientAverager(
        peers[0], dht=swarm[0], prefix="accumulate", averaged_grads=buffers, target_group_size=2, **FAST
    )
    b = GradientAverager(peers[1], dht=swarm[1], prefix="accumulate", target_group_size=2, **FAST)
    try:
        sizes, total = [4, 2, 6], [torch.zeros(p.shape, dtype=torch.float64) for p in peers[0]]
        for k, size in enumerate(sizes):  # each .grad is the mean over its micro-batch
            grads = set_grads(peers[0], 10 + k)
            a.accumulate_grads_(size)
            total = [t + size * g.double() for t, g in zip(total, grads)]
        assert a.local_samples_accumulated == 12 and a.local_times_accumulated == 3
        grads_b = set_grads(peers[1], 20)
        b.accumulate_grads_(6)
        controls = [a.step(wait=False, timeout=20), b.step(wait=False, timeout=20)]
        for control in controls:
            control.result()
        expected = [(t + 6 * g.double()) / 18 for t, g in zip(total, grads_b)]
        for got, want in zip(buffers, expected):
            assert torch.allclose(got.double(), want, atol=1e-6), "the caller's buffers hold the exact mean"
        for got, want in zip(averaged(b), expected):
            assert torch.allclose(got.double(), want, atol=1e-6)
    finally:
        shutdown(a, b)


def test_reuse_grad_buffers_matches_the_full_batch_gradient(swarm):
    torch.manual_seed(0)
    template = torch.nn.Linear(6, 2)
    models = [torch.nn.Linear(6, 2) for _ in range(2)]
    for model in models:
        model.load_state_dict(template.state_dict())
    data = [torch.randn(4, 6) for _ in range(4)]  # two micro-batches of 4 per peer
    averagers = [
        GradientAverager(
            model.parameters(), dht=dht, prefix="reuse", reuse_grad_buffers=True, target_group_size=2, **FAST
        )
        for model, dht in zip(models, swarm)
    ]
    try:
        for i, (model, averager) in enumerate(zip(models, averagers)):
            for batch in data[2 * i : 2 * i + 2]:
                model(batch).square().mean().backward()  # no zero_grad: .grad accumulates
                averager.accumulate_grads_(len(batch))
        controls = [averager.step(wait=False, timeout=20) for averager in averagers]
        for control in controls:
            control.result()
        template(torch.cat(data)).square().mean().backward()
        for model, averager in zip(models, averagers):
            for param in model.parameters():
                assert torch.equal(param.grad, torch.zeros_like(param)), "the reset zeroes .grad"
            for got, param in zip(averaged(averager), template.parameters()):
                assert torch.allclose(got, param.grad, atol=1e-6)
    finally:
        shutdown(*averagers)


def wait_for_stage(control, stage, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while control.stage != stage:
        assert not control.done(), f"the step ended early: {control.result()}"
        assert time.monotonic() < deadline, f"the step never reached {stage}"
        time.sleep(0.01)


def test_schedule_step_matches_ahead_and_waits_for_the_trigger(swarm):
    peers = [make_params(i) for i in range(2)]
    averagers = [
        GradientAverager(params, dht=dht, prefix="scheduled", target_group_size=2, **FAST)
        for params, dht in zip(peers, swarm)
    ]
    try:
        controls = [averager.schedule_step(timeout=20) for averager in averagers]
        for control in controls:
            wait_for_stage(control, AveragingStage.AWAITING_TRIGGER)
        local = []  # the gradients arrive only after the group has formed
        for i, (params, averager) in enumerate(zip(peers, averagers)):
            local.append(set_grads(params, i))
            averager.accumulate_grads_(1 + 3 * i)
        results = [
            averager.step(control=control, wait=False) for averager, control in zip(averagers, controls)
        ]
        for result in results:
            assert len(result.result(20)) == 2
        expected = [(1 * g0.double() + 4 * g1.double()) / 5 for g0, g1 in zip(*local)]
        for got, want in zip(averaged(averagers[0]), expected):
            assert torch.allclose(got.double(), want, atol=1e-6)
        with pytest.raises(RuntimeError, match="already triggered"):
            averagers[0].step(control=controls[0])
    finally:
        shutdown(*averagers)


def test_a_peer_without_a_group_is_told_and_keeps_its_local_gradients(swarm):
    params = make_params(0)
    averager = GradientAverager(params, dht=swarm[0], prefix="alone", target_group_size=2, **FAST)
    try:
        sizes, grads = [2, 6], [set_grads(params, 30)]
        averager.accumulate_grads_(sizes[0])
        grads.append(set_grads(params, 31))
        averager.accumulate_grads_(sizes[1])
        with pytest.raises(AveragingError, match="could not find a group"):
            averager.step(timeout=2)
        expected = [(2 * a.double() + 6 * b.double()) / 8 for a, b in zip(*grads)]
        for got, want in zip(averaged(averager), expected):
            assert torch.allclose(got.double(), want, atol=1e-6), "the local mean gradient is kept"

        control = averager.schedule_step(timeout=1)  # pre-scheduled, and already failed when triggered
        grads = set_grads(params, 32)
        averager.accumulate_grads_(3)
        deadline = time.monotonic() + 15
        while not control.done():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(AveragingError, match="could not find a group"):
            averager.step(control=control)
        for got, want in zip(averaged(averager), grads):
            assert torch.allclose(got, want, atol=1e-6)
    finally:
        averager.shutdown()


# --- PowerSGD -----------------------------------------------------------------------------------

POWER_SHAPES = [(16, 12), (4, 6, 8), (12,), (2, 3)]  # factorised, as 24x8, whole, whole (too small)


def power_params(seed: int, dtype=torch.float32) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in POWER_SHAPES]


def reference_round(grads_per_peer, weights, qs, errors):
    """PowerSGD done locally in float64: returns (averaged grads, new qs, new errors per peer)."""
    total = sum(weights)
    ms = [
        [e + g[k].double().reshape(matrix_shape(g[k].shape)) for k, e in zip((0, 1), errs)]
        for g, errs in zip(grads_per_peer, errors)
    ]
    ps = [sum(w * m[j] @ qs[j] for w, m in zip(weights, ms)) / total for j in range(2)]
    ps = [orthogonalize_(p) for p in ps]
    new_qs = [sum(w * m[j].T @ ps[j] for w, m in zip(weights, ms)) / total for j in range(2)]
    approximations = [p @ q.T for p, q in zip(ps, new_qs)]
    result = [approximations[0], approximations[1].reshape(POWER_SHAPES[1])]
    result += [sum(w * g[k].double() for w, g in zip(weights, grads_per_peer)) / total for k in (2, 3)]
    new_errors = [[m[j] - approximations[j] for j in range(2)] for m in ms]
    return result, new_qs, new_errors


def test_powersgd_matches_a_local_reference_and_feeds_back_its_error(swarm):
    n, weights = 3, [2, 1, 5]
    peers = [power_params(i) for i in range(n)]
    averagers = [
        PowerSGDGradientAverager(params, 2, dht=dht, prefix="power", target_group_size=n, **FAST)
        for params, dht in zip(peers, swarm)
    ]
    try:
        _, qs, _ = averagers[0].get_current_state()
        assert [tuple(q.shape) for q in qs] == [(12, 2), (8, 2)], "only the two big tensors are factorised"
        for other in averagers[1:]:
            for a, b in zip(qs, other.get_current_state()[1]):
                assert torch.equal(a, b), "everyone starts from the same Q"
        qs = [q.double() for q in qs]
        errors = [[torch.zeros(16, 12, dtype=torch.float64), torch.zeros(24, 8, dtype=torch.float64)]] * n
        for round_index in range(2):
            local = []
            for i, (params, averager) in enumerate(zip(peers, averagers)):
                local.append(set_grads(params, 100 * round_index + i))
                averager.accumulate_grads_(weights[i])
            controls = [averager.step(wait=False, timeout=20) for averager in averagers]
            for control in controls:
                control.result()
            expected, qs, errors = reference_round(local, weights, qs, errors)
            for averager in averagers:
                for got, want in zip(averaged(averager), expected):
                    assert torch.allclose(got.double(), want, atol=1e-4), f"round {round_index}"
                for got, want in zip(averager.get_current_state()[1], qs):
                    assert torch.allclose(got.double(), want, atol=1e-4), "Q is shared state"
            for averager, want in zip(averagers, errors):
                for got, target in zip(averager._ms, want):
                    assert torch.allclose(got.double(), target, atol=1e-4), "error feedback: the residual"
            assert any(e.abs().max() > 1e-3 for peer in errors for e in peer), "rank 2 is lossy here"
        newcomer = PowerSGDGradientAverager(power_params(9), 2, dht=swarm[3], prefix="power", **FAST)
        averagers.append(newcomer)
        assert newcomer.load_state_from_peers(timeout=15) is not None
        for got, want in zip(newcomer.get_current_state()[1], qs):
            assert torch.allclose(got.double(), want, atol=1e-4), "a newcomer adopts the swarm's Q"
    finally:
        shutdown(*averagers)


def test_matrix_views_and_orthogonalisation():
    assert matrix_shape((16, 12)) == (16, 12)
    assert matrix_shape((4, 6, 8)) == (24, 8)
    assert matrix_shape((64, 3, 3, 3)) == (64, 27)
    matrix = orthogonalize_(torch.randn(50, 4, generator=torch.Generator().manual_seed(3)))
    assert torch.allclose(matrix.T @ matrix, torch.eye(4), atol=1e-5)
    zeros = orthogonalize_(torch.zeros(5, 2))
    assert torch.equal(zeros, torch.zeros(5, 2)), "zero gradients stay zero, no NaN"


def test_powersgd_with_bf16_gradients(swarm):
    weights = [1, 3]
    peers = [power_params(i, torch.bfloat16) for i in range(2)]
    averagers = [
        PowerSGDGradientAverager(params, 2, dht=dht, prefix="power16", target_group_size=2, **FAST)
        for params, dht in zip(peers, swarm)
    ]
    try:
        qs = [q.double() for q in averagers[0].get_current_state()[1]]
        local = []
        for i, (params, averager) in enumerate(zip(peers, averagers)):
            local.append(set_grads(params, 7 + i))
            averager.accumulate_grads_(weights[i])
        for control in [averager.step(wait=False, timeout=20) for averager in averagers]:
            control.result()
        errors = [[torch.zeros(16, 12, dtype=torch.float64), torch.zeros(24, 8, dtype=torch.float64)]] * 2
        expected, _, _ = reference_round(local, weights, qs, errors)
        for got, want in zip(averaged(averagers[1]), expected):
            assert got.dtype == torch.bfloat16
            assert torch.allclose(got.double(), want, atol=3e-2, rtol=1e-2)
    finally:
        shutdown(*averagers)


def test_powersgd_and_plain_peers_refuse_each_other_cleanly(swarm):
    power = PowerSGDGradientAverager(
        power_params(0), 2, dht=swarm[0], prefix="mixed", target_group_size=2, **FAST
    )
    plain = GradientAverager(power_params(1), dht=swarm[1], prefix="mixed", target_group_size=2, **FAST)
    try:
        assert power.schema_hash != plain.schema_hash
        controls = [averager.step(wait=False, timeout=3) for averager in (power, plain)]
        for control in controls:
            with pytest.raises(AveragingError, match="could not find a group"):
                control.result()
        assert power.is_alive() and plain.is_alive()
    finally:
        shutdown(power, plain)
