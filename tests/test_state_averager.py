"""TrainingStateAverager over real DHT peers on 127.0.0.1: averaging, offloading, the delta rule,
state download with epochs and schedulers, refusals and bounded failures."""

import copy
import functools
import threading
import time

import pytest
import torch

from plexus.averaging.control import AveragingStage
from plexus.dht.dht import DHT
from plexus.optim import TrainingStateAverager
from plexus.optim.state_averager import StateLoadError

pytestmark = pytest.mark.timeout(60)
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
# request_timeout also bounds the DHT store of a matchmaking declaration: generous for loaded CI machines
FAST = dict(min_matchmaking_time=1.0, request_timeout=2.0)
ADAM = functools.partial(torch.optim.Adam, lr=0.1)
STATS = ("exp_avg", "exp_avg_sq")


def make_swarm(n: int) -> list[DHT]:
    first = DHT(start=True, host_maddrs=LOCAL)
    return [first] + [
        DHT(initial_peers=first.get_visible_maddrs(), start=True, host_maddrs=LOCAL) for _ in range(n - 1)
    ]


def close(*things) -> None:
    for thing in things:
        thing.shutdown()


def make_model(seed: int, sizes=(4, 3)) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(*sizes)


def set_grads(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(100 + seed)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator)


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_three_peers_average_parameters_and_adam_statistics():
    dhts = make_swarm(3)
    models = [make_model(i) for i in range(3)]
    averagers = [
        TrainingStateAverager(
            dht=dht,
            optimizer=ADAM,
            params=model.parameters(),
            average_opt_statistics=STATS,
            prefix="adam",
            target_group_size=3,
            min_group_size=3,
            start=True,
            **FAST,
        )
        for dht, model in zip(dhts, models)
    ]
    try:
        # the same step on plain local copies: what each peer holds before the round
        expected_params, expected_stats = [], []
        for i, model in enumerate(models):
            twin = copy.deepcopy(model)
            set_grads(twin, i)
            opt = torch.optim.Adam(twin.parameters(), lr=0.1)
            opt.step()
            expected_params.append([p.detach() for p in twin.parameters()])
            expected_stats.append([opt.state[p][key] for key in STATS for p in twin.parameters()])
        for i, (model, averager) in enumerate(zip(models, averagers)):
            set_grads(model, i)
            averager.step(
                increment_epoch=True,
                optimizer_step=True,
                zero_grad=True,
                averaging_round=True,
                delay_averaging=True,
                averaging_opts=dict(timeout=20),
            )
        for averager in averagers:
            averager.step(wait_for_delayed_updates=True)
        mean_params = [sum(column) / 3 for column in zip(*expected_params)]
        mean_stats = [sum(column) / 3 for column in zip(*expected_stats)]
        for model, averager in zip(models, averagers):
            assert averager.local_epoch == 1 and averager.state_sharing_priority == 1
            assert all(p.grad is None for p in model.parameters())
            for param, target in zip(model.parameters(), mean_params):
                assert torch.allclose(param, target, atol=1e-6)
            stats = [averager.optimizer.state[p][key] for key in STATS for p in model.parameters()]
            for stat, target in zip(stats, mean_stats):
                assert torch.allclose(stat, target, atol=1e-6)
    finally:
        close(*averagers, *dhts)


def test_offloaded_optimizer_and_delayed_step():
    dht = DHT(start=True, host_maddrs=LOCAL)
    model = make_model(0)
    before = [p.detach().clone() for p in model.parameters()]
    sgd = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)
    averager = TrainingStateAverager(
        dht=dht,
        optimizer=sgd,
        params=model.parameters(),
        offload_optimizer=True,
        prefix="offload",
        start=True,
        **FAST,
    )
    try:
        with pytest.raises(ValueError, match="factory"):
            TrainingStateAverager(
                dht=dht,
                optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                offload_optimizer=True,
                prefix="offload2",
            )
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), (
            "initializing changed the model"
        )
        copies = [p for group in averager.optimizer.param_groups for p in group["params"]]
        assert all(
            c.device.type == "cpu" and c.dtype == torch.float32 and c is not p
            for c, p in zip(copies, model.parameters())
        )

        set_grads(model, 0)
        grads = [p.grad.clone() for p in model.parameters()]
        averager.step(optimizer_step=True, zero_grad=True, delay_optimizer_step=True)
        # the model changes only inside step(); the gradients were handed over at the call
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        assert all(p.grad is None for p in model.parameters())
        for param in model.parameters():
            param.grad = torch.full_like(param, 1000.0)  # the next batch's gradients, not this step's
        averager.step(wait_for_delayed_updates=True)
        for param, old, grad in zip(model.parameters(), before, grads):
            assert torch.allclose(param, old - 0.5 * grad, atol=1e-6)

        # a step that is waited for: momentum applies, the model is updated before step() returns
        averager.step(optimizer_step=True, zero_grad=True)
        for param, old, grad in zip(model.parameters(), before, grads):
            assert torch.allclose(param, old - 0.5 * grad - 0.5 * (0.9 * grad + 1000.0), atol=1e-4)

        with pytest.raises(ValueError, match="offload_optimizer"):
            TrainingStateAverager(
                dht=dht, optimizer=torch.optim.SGD(make_model(1).parameters(), lr=1.0), prefix="not_offloaded"
            ).step(optimizer_step=True, delay_optimizer_step=True)
    finally:
        close(averager, dht)


def test_delta_rule_keeps_local_progress_made_during_a_round():
    dhts = make_swarm(2)
    models = [make_model(i) for i in range(2)]
    sgd = functools.partial(torch.optim.SGD, lr=0.25)
    averagers = [
        TrainingStateAverager(
            dht=dht,
            optimizer=sgd,
            params=model.parameters(),
            delta_rule_averaging=True,
            prefix="delta",
            target_group_size=2,
            start=True,
            **FAST,
        )
        for dht, model in zip(dhts, models)
    ]
    try:
        start = [[p.detach().clone() for p in model.parameters()] for model in models]
        first = averagers[0]
        first.step(averaging_round=True, delay_averaging=True, averaging_opts=dict(timeout=20))
        wait_until(lambda: first.delay_before_averaging.num_updates == 1)  # its tensors are loaded
        set_grads(models[0], 0)
        grads = [p.grad.clone() for p in models[0].parameters()]
        first.step(optimizer_step=True, zero_grad=True)  # runs while the round waits for the second peer
        assert all(
            torch.allclose(p, s - 0.25 * g) for p, s, g in zip(models[0].parameters(), start[0], grads)
        )
        averagers[1].step(averaging_round=True, averaging_opts=dict(timeout=20))
        first.step(wait_for_delayed_updates=True)
        mean = [(a + b) / 2 for a, b in zip(*start)]
        for param, target, grad in zip(models[0].parameters(), mean, grads):
            assert torch.allclose(param, target - 0.25 * grad, atol=1e-6), "the local step was lost"
        for param, target in zip(models[1].parameters(), mean):
            assert torch.allclose(param, target, atol=1e-6)
    finally:
        close(*averagers, *dhts)


def test_late_joiner_loads_state_epoch_and_learning_rate_and_refuses_stale_donors():
    dhts = make_swarm(3)
    schedule = functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda epoch: 0.5**epoch)
    models = [make_model(i) for i in range(2)]
    donors = [
        TrainingStateAverager(
            dht=dht,
            optimizer=ADAM,
            params=model.parameters(),
            scheduler=schedule,
            average_opt_statistics=STATS,
            prefix="late",
            target_group_size=2,
            start=True,
            **FAST,
        )
        for dht, model in zip(dhts, models)
    ]
    joiner_model = make_model(7)
    joiner = TrainingStateAverager(
        dht=dhts[2],
        optimizer=ADAM,
        params=joiner_model.parameters(),
        scheduler=schedule,
        offload_optimizer=True,
        prefix="late",
        start=True,
        **FAST,
    )
    try:
        for epoch in range(3):
            for i, (model, donor) in enumerate(zip(models, donors)):
                set_grads(model, 10 * epoch + i)
                donor.step(
                    increment_epoch=True,
                    optimizer_step=True,
                    zero_grad=True,
                    averaging_round=True,
                    delay_averaging=True,
                    averaging_opts=dict(timeout=20),
                )
            for donor in donors:
                donor.step(wait_for_delayed_updates=True)
        assert [d.local_epoch for d in donors] == [3, 3]
        assert donors[0].optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)

        # a delayed step of the joiner's own is still unapplied when it loads: it must not win (hivemind #417)
        set_grads(joiner_model, 99)
        joiner.step(optimizer_step=True, zero_grad=True, delay_optimizer_step=True)
        assert joiner.load_state_from_peers(timeout=20) is True
        joiner.step()  # applies "delayed updates": there must be none left
        assert joiner.local_epoch == 3 and joiner.state_sharing_priority == 3
        assert joiner.scheduler._step_count == 4
        assert joiner.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
        for mine, theirs in zip(joiner_model.parameters(), models[0].parameters()):
            assert torch.allclose(mine, theirs, atol=1e-6)
        joiner_params = [p for g in joiner.optimizer.param_groups for p in g["params"]]
        for mine, theirs in zip(joiner_params, models[0].parameters()):
            assert torch.allclose(mine, theirs.detach(), atol=1e-6)
            for key in (*STATS, "step"):
                assert torch.allclose(
                    joiner.optimizer.state[mine][key], donors[0].optimizer.state[theirs][key]
                )

        # the joiner moves ahead; donors now behind it are refused and its state is kept
        joiner.step(increment_epoch=True)
        joiner.step(increment_epoch=True)
        kept = [p.detach().clone() for p in joiner_model.parameters()]
        assert joiner.load_state_from_peers(timeout=20) is False
        assert joiner.local_epoch == 5
        assert joiner.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**5)
        assert all(torch.equal(p, k) for p, k in zip(joiner_model.parameters(), kept))
    finally:
        close(joiner, *donors, *dhts)


def test_unusable_state_ends_in_a_clear_error_after_bounded_attempts():
    dhts = make_swarm(2)
    donor = TrainingStateAverager(
        dht=dhts[0],
        optimizer=ADAM,
        params=make_model(0, (5, 2)).parameters(),
        prefix="mismatch",
        start=True,
        **FAST,
    )
    joiner = TrainingStateAverager(
        dht=dhts[1], optimizer=ADAM, params=make_model(1).parameters(), prefix="mismatch", start=True, **FAST
    )
    alone = TrainingStateAverager(
        dht=dhts[1],
        optimizer=ADAM,
        params=make_model(2).parameters(),
        prefix="nobody_here",
        start=True,
        **FAST,
    )
    try:
        assert alone.load_state_from_peers(timeout=5) is False, "the first peer of a run has nobody to ask"
        started = time.monotonic()
        with pytest.raises(StateLoadError, match=r"after 2 attempts.*shape \(2, 5\), ours is \(3, 4\)"):
            joiner.load_state_from_peers(timeout=5, max_attempts=2, retry_backoff=0.05)
        assert time.monotonic() - started < 15
        assert joiner.local_epoch == 0
        # the swarm is known to be at epoch 1 but the only donor is at 0: not adopted, a clear error
        with pytest.raises(StateLoadError, match=r"after 2 attempts.*priority 1(\.0)? or newer.*is 0"):
            joiner.load_state_from_peers(timeout=5, max_attempts=2, retry_backoff=0.05, min_epoch=1)
        assert time.monotonic() - started < 30
    finally:
        close(alone, joiner, donor, *dhts)


def test_prescheduled_round_waits_for_its_trigger_and_syncs_the_epoch():
    dhts = make_swarm(2)
    schedule = functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda epoch: 0.5**epoch)
    models = [make_model(i) for i in range(2)]
    averagers = [
        TrainingStateAverager(
            dht=dht,
            optimizer=ADAM,
            params=model.parameters(),
            scheduler=schedule,
            sync_epoch_when_averaging=True,
            prefix="sched",
            target_group_size=2,
            start=True,
            **FAST,
        )
        for dht, model in zip(dhts, models)
    ]
    try:
        averagers[0].step(increment_epoch=True)
        averagers[0].step(increment_epoch=True)
        triggers = [threading.Event(), threading.Event()]
        controls = [a.schedule_step(timeout=20) for a in averagers]  # matchmaking starts now
        for averager, control, trigger in zip(averagers, controls, triggers):
            averager.step(
                averaging_round=True,
                averaging_control=control,
                wait_for_trigger=trigger.wait,
                delay_averaging=True,
            )
        wait_until(lambda: all(c.stage == AveragingStage.AWAITING_TRIGGER for c in controls))
        assert not any(c.done() for c in controls), "the all-reduce ran before its trigger"
        for trigger in triggers:
            trigger.set()
        for averager in averagers:
            averager.step(wait_for_delayed_updates=True)
        assert [a.local_epoch for a in averagers] == [2, 2]
        assert averagers[1].optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.25)
        for a, b in zip(*(model.parameters() for model in models)):
            assert torch.allclose(a, b)
    finally:
        close(*averagers, *dhts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offloaded_optimizer_with_a_cuda_half_precision_model():
    dht = DHT(start=True, host_maddrs=LOCAL)
    model = make_model(0).cuda().half()
    before = [p.detach().float().cpu() for p in model.parameters()]
    averager = TrainingStateAverager(
        dht=dht,
        optimizer=functools.partial(torch.optim.SGD, lr=0.5),
        params=model.parameters(),
        offload_optimizer=True,
        prefix="cuda",
        start=True,
    )
    try:
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        averager.step(optimizer_step=True, zero_grad=True)
        for param, old in zip(model.parameters(), before):
            assert param.device.type == "cuda" and param.dtype == torch.float16
            assert torch.allclose(param.float().cpu(), old - 0.5, atol=1e-2)
        _metadata, tensors, _ = averager.get_current_state()
        assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors[:2])
    finally:
        close(averager, dht)


def test_shared_state_names_the_epoch_of_the_parameters_it_holds():
    """increment_epoch moves local_epoch at once, but what newcomers download says epoch 1 only once
    the parameters hold epoch 1's optimizer step (else a newcomer would stay one step short)."""
    dht = DHT(start=True, host_maddrs=LOCAL)
    model = make_model(0)
    averager = TrainingStateAverager(
        dht=dht,
        optimizer=functools.partial(torch.optim.SGD, lr=0.5),
        params=model.parameters(),
        offload_optimizer=True,
        prefix="epochs",
        start=True,
        **FAST,
    )
    gate = threading.Event()
    try:
        before = [p.detach().clone() for p in averager._optimized_parameters()]
        set_grads(model, 0)
        averager.step(
            increment_epoch=True, optimizer_step=True, delay_optimizer_step=True, wait_for_trigger=gate.wait
        )  # the step waits, as for a gradient round
        assert averager.local_epoch == 1
        with averager.get_tensors():
            metadata, tensors, _ = averager.get_current_state()
            assert metadata["epoch"] == 0 and averager.state_sharing_priority == 0
            assert all(torch.equal(tensor, old) for tensor, old in zip(tensors, before))
        gate.set()
        averager.step(wait_for_delayed_updates=True)
        with averager.get_tensors():
            metadata, tensors, _ = averager.get_current_state()
            assert metadata["epoch"] == 1 and averager.state_sharing_priority == 1
            assert not torch.equal(tensors[0], before[0])
    finally:
        gate.set()
        close(averager, dht)
