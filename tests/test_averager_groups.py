"""DecentralizedAverager, driven directly: `expected_group_size` lets a group form as soon as the
peers we expect have joined (not at min_matchmaking_time), and `weight_for_group` sets a peer's
weight from what the whole group gathered."""

import functools
import math
import time

import pytest
import torch

from plexus.averaging.averager import AveragingError, DecentralizedAverager
from plexus.averaging.control import AveragingStage
from tests.test_averager import close, make_swarm

SLOW = dict(min_matchmaking_time=30.0, request_timeout=0.5)  # far longer than any test below may take


def value_of(rank: int) -> torch.Tensor:
    return torch.arange(16, dtype=torch.float64) + 10.0 * rank


def swarm_of_averagers(n: int, prefix: str, **options):
    dhts = make_swarm(n)
    averagers = [
        DecentralizedAverager([value_of(i)], dht, prefix=prefix, start=True, **SLOW, **options)
        for i, dht in enumerate(dhts)
    ]
    return dhts, averagers


def wait_until_started(control, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while control.stage == AveragingStage.IDLE:
        assert time.monotonic() < deadline, "the step never began matchmaking"
        time.sleep(0.01)


@pytest.mark.timeout(40)
def test_expected_group_assembles_once_everyone_joined():
    dhts, averagers = swarm_of_averagers(3, "expected")  # no target_group_size: expected_group_size decides
    try:
        started = time.monotonic()
        first = [
            a.step(gather=i, wait=False, timeout=25, expected_group_size=3)
            for i, a in enumerate(averagers[:2])
        ]
        for control in first:  # the first two look for a group (and must not form one of two) ...
            wait_until_started(control)
        last = averagers[2].step(
            gather=2, wait=False, timeout=25, expected_group_size=3
        )  # ... until the third
        results = [control.result() for control in first + [last]]
        assert time.monotonic() - started < 15, "the group must not wait out min_matchmaking_time (30 s)"
        for averager, result in zip(averagers, results):
            assert sorted(result.values()) == [0, 1, 2]
            with averager.get_tensors() as (tensor,):
                assert torch.allclose(tensor, value_of(1)), "the plain mean of ranks 0, 1, 2"
    finally:
        close(*averagers, *dhts)


def weight_by_group(rank: int, calls: list, gathered: dict, weight: float) -> float:
    """The newest rank in the group withdraws; the others weigh by rank + 1."""
    calls.append(sorted(gathered.values()))
    return 0.0 if rank == max(gathered.values()) else weight * (rank + 1)


@pytest.mark.timeout(40)
def test_weight_for_group_sets_the_weights_from_the_gathered_metadata():
    dhts, averagers = swarm_of_averagers(3, "weights", target_group_size=3)
    calls = []
    try:
        controls = [
            a.step(
                gather=i,
                weight=2.0,
                wait=False,
                timeout=25,
                weight_for_group=functools.partial(weight_by_group, i, calls),
            )
            for i, a in enumerate(averagers)
        ]
        for control in controls:
            control.result()
        assert calls == [[0, 1, 2]] * 3, "each peer's callback sees what every member gathered"
        weights = [2.0 * 1, 2.0 * 2, 0.0]
        expected = sum(w * value_of(i) for i, w in enumerate(weights)) / sum(weights)  # = (v0 + 2 v1) / 3
        for averager in averagers:
            with averager.get_tensors() as (tensor,):
                assert torch.allclose(tensor, expected)
    finally:
        close(*averagers, *dhts)


@pytest.mark.timeout(60)
def raise_value_error(gathered, weight):
    raise ValueError("no weight for this group")


@pytest.mark.parametrize(
    "callback, error",
    [
        (lambda gathered, weight: -1.0, "weight_for_group returned -1.0; a weight must be finite and >= 0"),
        (
            lambda gathered, weight: math.nan,
            "weight_for_group returned nan; a weight must be finite and >= 0",
        ),
        (raise_value_error, "weight_for_group raised ValueError..no weight for this group"),  # not retried
    ],
)
def test_bad_weight_from_the_callback_fails_that_step_at_once(callback, error):
    """A weight the callback makes up that no average can use fails that peer's step at once with
    an error naming the callback (no retry: it is the caller's bug), and the rest of the group is
    not left hanging."""
    dhts, averagers = swarm_of_averagers(
        3, "bad", target_group_size=3, sender_timeout=1.0, reducer_timeout=2.0
    )
    try:
        controls = [
            a.step(wait=False, timeout=25, weight_for_group=callback if i == 0 else None)
            for i, a in enumerate(averagers)
        ]
        with pytest.raises(AveragingError, match=error):
            controls[0].result(timeout=20)
        for control in controls[1:]:  # they exclude peer 0 after reducer_timeout; its span keeps local values
            assert len(control.result(timeout=30)) == 3
        with averagers[0].get_tensors() as (tensor,):
            assert torch.equal(tensor, value_of(0)), "the refused step left this peer's tensors alone"
    finally:
        close(*averagers, *dhts)
