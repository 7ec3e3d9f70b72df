"""One bad peer among four, through the public averagers on 127.0.0.1: DecentralizedAverager,
GradientAverager, PowerSGDGradientAverager and TrainingStateAverager. The peers are honest code fed
bad data (NaN tensors, huge values, a giant weight), or, for a reducer that answers wrongly, an
averager whose `allreduce_runner` overrides the documented `reduced` seam."""

import pytest
import torch

from plexus.averaging.aggregation import RobustAggregation
from plexus.averaging.allreduce import AllReduceRunner
from plexus.averaging.averager import DecentralizedAverager
from plexus.optim.grad_averager import GradientAverager
from plexus.optim.power_sgd_averager import PowerSGDGradientAverager
from plexus.optim.state_averager import TrainingStateAverager
from plexus.testing import wait_until
from tests.test_grad_averager import swarm  # noqa: F401  (a module-wide swarm of four DHT peers)

pytestmark = pytest.mark.timeout(60)
FAST = dict(min_matchmaking_time=1.0, request_timeout=0.5, start=True, target_group_size=4, min_group_size=4)


def values(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(3000, generator=generator) + 1, torch.randn(16, 9, generator=generator)]


def step_all(averagers, weights=None, timeout=30):
    controls = [
        a.step(wait=False, timeout=timeout, weight=None if weights is None else weights[i])
        for i, a in enumerate(averagers)
    ]
    return [control.result() for control in controls]


def mean(tensor_sets, weights):
    return [
        sum(w * ts[k].double() for ts, w in zip(tensor_sets, weights)) / sum(weights)
        for k in range(len(tensor_sets[0]))
    ]


def distance(tensors, reference) -> float:
    return max(float(torch.linalg.vector_norm(t.double() - r)) for t, r in zip(tensors, reference))


class WrongReducer(AllReduceRunner):
    def reduced(self, part, average):
        return average * -3.0


def test_nan_bomb_and_giant_weight_through_decentralized_averager(swarm):  # noqa: F811
    local = [values(i) for i in range(4)]
    local[3][0][:5] = float("nan")  # a few elements of one tensor
    originals = [[t.clone() for t in ts] for ts in local]
    averagers = [DecentralizedAverager(ts, dht, prefix="nan-bomb", **FAST) for ts, dht in zip(local, swarm)]
    try:
        step_all(averagers)
        honest, everyone = mean(originals[:3], [1] * 3), mean(originals, [1] * 4)
        for tensors in local[:3]:  # its NaN part was refused; the parts of other spans were fine data
            assert all(torch.isfinite(t).all() for t in tensors)
            assert float((tensors[0][:5].double() - honest[0][:5]).abs().max()) <= 1e-5
            assert distance(tensors[1:], everyone[1:]) <= 1e-5
        for i, tensors in enumerate(local):  # the attacker's finite values next round, with a giant weight
            for t, fresh in zip(tensors, values(i)):
                t.copy_(fresh)
        step_all(averagers, weights=[1.0, 1.0, 1.0, 1e9])
        bounded = mean([values(i) for i in range(4)], [1, 1, 1, 8])  # 8 x the median: max_weight_ratio
        assert distance(local[0], bounded) <= 1e-4
    finally:
        for averager in averagers:
            averager.shutdown()


def test_robust_averager_bounds_huge_values_and_discards_a_wrong_reducer(swarm):  # noqa: F811
    local = [values(i) for i in range(4)]
    local[3] = [t * 1e30 for t in local[3]]
    originals = [[t.clone() for t in ts] for ts in local]
    averagers = [
        DecentralizedAverager(ts, dht, prefix="robust", robust=RobustAggregation(), **FAST)
        for ts, dht in zip(local, swarm)
    ]
    try:
        step_all(averagers)
        honest = mean(originals[:3], [1] * 3)
        spread = max(distance(ts, honest) for ts in originals[:3])
        for tensors in local[:3]:
            assert distance(tensors, honest) <= 2 * spread  # the plain mean would be ~2.5e29 away
        averagers[1].allreduce_runner = WrongReducer  # from now on peer 1 answers its span wrongly
        for i, tensors in enumerate(local):  # distinct values again: a round must change them
            for t, fresh in zip(tensors, values(i)):
                t.copy_(fresh)
        step_all(averagers)
        quarter = sum(t.numel() for t in local[0]) / 4
        for i, tensors in enumerate(local):
            assert all(torch.isfinite(t).all() for t in tensors)
            kept = sum(int((t == fresh).sum()) for t, fresh in zip(tensors, values(i)))
            assert abs(kept - quarter) <= 64, "exactly the liar's span (a quarter) kept its local values"
    finally:
        for averager in averagers:
            averager.shutdown()


def test_nan_gradients_and_parameters_through_the_optimizer_averagers(swarm):  # noqa: F811
    params = [[torch.nn.Parameter(t.clone()) for t in values(i)] for i in range(4)]
    grads = [values(10 + i) for i in range(4)]
    grads[3][1].fill_(float("inf"))
    for kind, cls in (("grad", GradientAverager), ("powersgd", PowerSGDGradientAverager)):
        extra = (2,) if cls is PowerSGDGradientAverager else ()
        averagers = [cls(ps, *extra, dht=dht, prefix=kind, **FAST) for ps, dht in zip(params, swarm)]
        try:
            for ps, gs, averager in zip(params, grads, averagers):
                for p, g in zip(ps, gs):
                    p.grad = g.clone()
                averager.accumulate_grads_(batch_size=4)
            controls = [averager.step(wait=False, timeout=30) for averager in averagers]
            for control in controls[:3]:
                control.result()
            for averager in averagers[:3]:
                with averager.use_averaged_gradients():
                    assert all(torch.isfinite(p.grad).all() for p in averager.parameters), kind
                    if cls is GradientAverager:
                        first = [p.grad for p in averager.parameters][:1]  # the attacker's is finite there
                        assert distance(first, mean(grads, [1] * 4)[:1]) <= 1e-4
        finally:
            for averager in averagers:
                averager.shutdown()
    models = [torch.nn.Linear(8, 4) for _ in range(4)]
    with torch.no_grad():
        models[3].weight.fill_(float("nan"))
    states = [
        TrainingStateAverager(
            dht=dht, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), prefix="state", **FAST
        )
        for m, dht in zip(models, swarm)
    ]
    try:
        for state in states:
            state.step(averaging_round=True, delay_averaging=True, averaging_opts=dict(timeout=30))
        for state in states:
            state.step(wait_for_delayed_updates=True)
        for model in models[:3]:
            assert all(torch.isfinite(p).all() for p in model.parameters())
    finally:
        for state in states:
            state.shutdown()


def test_a_newcomer_refuses_a_donors_nonfinite_state_and_loads_another(swarm):  # noqa: F811
    nan = torch.full((100,), float("nan"))
    poisoned = DecentralizedAverager([nan], swarm[0], prefix="donors", start=True)
    good = DecentralizedAverager([torch.ones(100)], swarm[1], prefix="donors", start=True)
    newcomer = DecentralizedAverager([torch.zeros(100)], swarm[2], prefix="donors", start=True)
    try:
        poisoned.state_sharing_priority, good.state_sharing_priority = 2.0, 1.0  # the NaN one looks newest
        loaded = []  # donors declare themselves in the DHT shortly after starting
        wait_until(
            lambda: loaded.append(newcomer.load_state_from_peers(timeout=10)) or loaded[-1] is not None,
            timeout=30,
            message="a donor's state was loaded",
        )
        _, tensors = loaded[-1]
        assert torch.equal(tensors[0], torch.ones(100)), "the good donor's state, not the newer NaN one"
    finally:
        for averager in (poisoned, good, newcomer):
            averager.shutdown()
