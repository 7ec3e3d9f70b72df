"""DecentralizedAverager end to end: matchmaking + all-reduce + state sharing over real hosts."""

import asyncio
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from plexus.averaging.averager import AveragingError, DecentralizedAverager
from plexus.averaging.control import AveragingStage, StepControl
from plexus.dht.dht import DHT

pytestmark = pytest.mark.timeout(90)
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
FAST = dict(min_matchmaking_time=1.0, request_timeout=0.5)


def make_swarm(n: int) -> list[DHT]:
    first = DHT(start=True, host_maddrs=LOCAL)
    return [first] + [
        DHT(initial_peers=first.get_visible_maddrs(), start=True, host_maddrs=LOCAL) for _ in range(n - 1)
    ]


def close(*things) -> None:
    for thing in things:
        thing.shutdown()


def tensors_of(i: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(i)
    return [
        torch.randn(1000, generator=generator),
        torch.randn(3, 7, generator=generator, dtype=torch.float64),
        torch.randn(5, generator=generator).to(torch.bfloat16),
    ]


@pytest.mark.parametrize("n", [2, 4])
def test_weighted_means_and_gather(n):
    dhts = make_swarm(n)
    averagers = [
        DecentralizedAverager(tensors_of(i), dht, prefix="mean", target_group_size=n, start=True, **FAST)
        for i, dht in enumerate(dhts)
    ]
    try:
        weights = [1.0 + i for i in range(n)]
        controls = [
            a.step(gather={"rank": i}, weight=w, wait=False, timeout=20)
            for i, (a, w) in enumerate(zip(averagers, weights))
        ]
        results = [control.result() for control in controls]
        expected = [
            sum(w * t[k].double() for w, t in zip(weights, map(tensors_of, range(n)))) / sum(weights)
            for k in range(3)
        ]
        for averager, result in zip(averagers, results):
            assert sorted(g["rank"] for g in result.values()) == list(range(n))
            assert set(result) == {a.peer_id for a in averagers}
            with averager.get_tensors() as tensors:
                for tensor, target in zip(tensors, expected):
                    tolerance = 1e-2 if tensor.dtype == torch.bfloat16 else 1e-5
                    assert torch.allclose(tensor.double(), target, atol=tolerance), (tensor, target)
    finally:
        close(*averagers, *dhts)


@pytest.mark.parametrize("strided", [False, True])
def test_rounds_average_the_callers_own_tensors_in_place(strided):
    """As in hivemind, the averaged tensors are the caller's own: each round leaves its result in
    them, and the next round starts from whatever they hold then. Contiguous tensors are read in
    place during the round; a strided view is copied first."""
    dhts = make_swarm(2)
    local = [[tensors_of(i)[0], tensors_of(i)[1].t() if strided else tensors_of(i)[1]] for i in range(2)]
    averagers = [
        DecentralizedAverager(local[i], dht, prefix="rounds", target_group_size=2, start=True, **FAST)
        for i, dht in enumerate(dhts)
    ]
    try:
        expected = [(a + b) / 2 for a, b in zip(*local)]
        for round_index in range(3):
            for control in [averager.step(wait=False, timeout=20) for averager in averagers]:
                control.result()
            for averager, tensors in zip(averagers, local):
                for tensor, target in zip(tensors, expected):
                    assert torch.allclose(tensor, target, atol=1e-5), (round_index, tensor, target)
                with averager.get_tensors() as yielded:
                    assert [t.data_ptr() for t in yielded] == [t.data_ptr() for t in tensors]
            for i, tensors in enumerate(local):  # new local values for the next round
                for tensor in tensors:
                    tensor.mul_(i + 2)
            expected = [target * (2 + 3) / 2 for target in expected]
    finally:
        close(*averagers, *dhts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_averaged_in_place_through_a_cpu_working_copy():
    dhts = make_swarm(2)
    local = [[t.cuda() for t in tensors_of(i)] for i in range(2)]
    averagers = [
        DecentralizedAverager(local[i], dht, prefix="cuda", target_group_size=2, start=True, **FAST)
        for i, dht in enumerate(dhts)
    ]
    try:
        for control in [averager.step(wait=False, timeout=20) for averager in averagers]:
            control.result()
        expected = [(a.double() + b.double()) / 2 for a, b in zip(tensors_of(0), tensors_of(1))]
        for tensors in local:
            for tensor, target in zip(tensors, expected):
                tolerance = 1e-2 if tensor.dtype == torch.bfloat16 else 1e-5
                assert tensor.device.type == "cuda"
                assert torch.allclose(tensor.double().cpu(), target, atol=tolerance), (tensor, target)
    finally:
        close(*averagers, *dhts)


def test_client_and_auxiliary_modes():
    dhts = make_swarm(3)
    client_dht = DHT(initial_peers=dhts[0].get_visible_maddrs(), start=True, client_mode=True)
    node_a = DecentralizedAverager(
        [torch.zeros(64)], dhts[0], prefix="modes", target_group_size=4, start=True, **FAST
    )
    node_b = DecentralizedAverager(
        [torch.full((64,), 4.0)], dhts[1], prefix="modes", target_group_size=4, start=True, **FAST
    )
    aux = DecentralizedAverager(
        [torch.full((64,), 100.0)],
        dhts[2],
        prefix="modes",
        target_group_size=4,
        auxiliary=True,
        start=True,
        **FAST,
    )
    client = DecentralizedAverager(
        [torch.full((64,), 8.0)], client_dht, prefix="modes", target_group_size=4, start=True, **FAST
    )
    try:
        controls = [a.step(wait=False, timeout=20) for a in (node_a, node_b, aux, client)]
        for control in controls:
            assert len(control.result()) == 4
        for averager in (node_a, node_b, client):
            with averager.get_tensors() as (tensor,):
                assert torch.allclose(tensor, torch.full((64,), 4.0)), (
                    "the mean of 0, 4 and 8; aux adds nothing"
                )
        with aux.get_tensors() as (tensor,):
            assert torch.equal(tensor, torch.full((64,), 100.0)), "an auxiliary peer's tensors are left alone"
        with pytest.raises(ValueError):
            aux.step(weight=1.0)
    finally:
        close(node_a, node_b, aux, client, client_dht, *dhts)


def test_lone_peer_gets_a_clear_error_and_trigger_gates_the_allreduce():
    dhts = make_swarm(2)
    a, b = (
        DecentralizedAverager(
            [torch.full((8,), float(i))], dht, prefix="gate", target_group_size=2, start=True, **FAST
        )
        for i, dht in enumerate(dhts)
    )
    try:
        with pytest.raises(AveragingError, match="could not find a group"):
            a.step(timeout=2)
        control_a = a.step(wait=False, require_trigger=True, timeout=20)
        control_b = b.step(wait=False, timeout=20)
        deadline = time.monotonic() + 10
        while control_a.stage != AveragingStage.AWAITING_TRIGGER:
            assert time.monotonic() < deadline, "the step never reached the trigger"
            time.sleep(0.01)
        assert not control_a.done()
        control_a.allow_allreduce()
        assert len(control_a.result(10)) == 2 and len(control_b.result(10)) == 2
        with a.get_tensors() as (tensor,):
            assert torch.allclose(tensor, torch.full((8,), 0.5))
    finally:
        close(a, b, *dhts)


def test_newcomer_downloads_state_while_the_donors_average():
    dhts = make_swarm(3)
    donors = [
        DecentralizedAverager(
            [torch.full((200_000,), float(i))], dht, prefix="state", target_group_size=2, start=True, **FAST
        )
        for i, dht in enumerate(dhts[:2])
    ]
    newcomer = DecentralizedAverager([torch.zeros(200_000)], dhts[2], prefix="state", start=True, **FAST)
    try:
        controls = [d.step(wait=False, timeout=20) for d in donors]
        _metadata, (tensor,) = newcomer.load_state_from_peers(timeout=20)
        assert tensor.shape == (200_000,)
        assert torch.all(tensor == tensor[0]) and tensor[0].item() in (0.0, 1.0, 0.5), "a consistent snapshot"
        for control in controls:
            control.result()
        _metadata, (tensor,) = newcomer.load_state_from_peers(timeout=20)
        assert torch.allclose(tensor, torch.full((200_000,), 0.5))
    finally:
        close(*donors, newcomer, *dhts)


def _peer_process(index: int, initial_peers, pipe, size: int) -> None:
    torch.set_num_threads(1)
    dht = DHT(initial_peers=initial_peers, start=True, host_maddrs=LOCAL)
    averager = DecentralizedAverager(
        [torch.full((size,), float(index))],
        dht,
        prefix="killed",
        target_group_size=3,
        min_matchmaking_time=2.0,
        request_timeout=1.0,
        sender_timeout=2.0,
        reducer_timeout=4.0,
        part_size_bytes=64 << 10,
        start=True,
    )
    pipe.send("ready")
    pipe.recv()
    control = averager.step(wait=False, timeout=30)
    while control.stage != AveragingStage.RUNNING_ALLREDUCE and not control.done():
        time.sleep(0.005)
    pipe.send("running")
    try:
        control.result()
        with averager.get_tensors() as (tensor,):
            pipe.send(("done", tensor[0].item(), tensor[-1].item()))
    except Exception as error:
        pipe.send(("error", repr(error)))
    pipe.recv()


@pytest.mark.slow
def test_a_peer_killed_mid_round_does_not_stop_the_others():
    context = mp.get_context("spawn")
    first = DHT(start=True, host_maddrs=LOCAL)
    size = 4_000_000
    pipes, processes = [], []
    try:
        for index in range(3):
            parent, child = context.Pipe()
            process = context.Process(
                target=_peer_process, args=(index, first.get_visible_maddrs(), child, size)
            )
            process.start()
            pipes.append(parent)
            processes.append(process)
        for pipe in pipes:
            assert pipe.poll(60) and pipe.recv() == "ready"
        for pipe in pipes:
            pipe.send("go")
        assert pipes[2].poll(30) and pipes[2].recv() == "running"
        os.kill(processes[2].pid, signal.SIGKILL)
        started = time.monotonic()
        for pipe in pipes[:2]:
            assert pipe.poll(30), "a survivor hung after its peer was killed"
            message = pipe.recv()
            if message == "running":
                assert pipe.poll(30), "a survivor hung after its peer was killed"
                message = pipe.recv()
            assert message[0] in ("done", "error"), message
            if message[0] == "done":  # each part either averaged or kept: finite, in range
                assert 0.0 <= message[1] <= 2.0 and 0.0 <= message[2] <= 2.0
        assert time.monotonic() - started < 30
    finally:
        for pipe in pipes:
            try:
                pipe.send("exit")
            except OSError:
                pass
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
        first.shutdown()


def test_a_cancelled_step_is_done_only_once_its_coroutine_has_unwound():
    """cancel() returns at once; done(), cancelled() and wait_ended() follow the coroutine, which
    may take a while to leave matchmaking. A step cancelled before its task started never runs."""
    loop = asyncio.new_event_loop()
    try:
        ran, unwound, release = [], [], asyncio.Event()

        async def records_that_it_ran():
            ran.append(True)

        unstarted = StepControl(loop, scheduled_time=0.0, weight=1.0, require_trigger=False)
        unstarted._start(records_that_it_ran())
        assert unstarted.cancel() and not unstarted.done()
        loop.run_until_complete(asyncio.sleep(0.01))
        assert unstarted.cancelled() and unstarted.wait_ended(0) and not ran

        async def slow_to_unwind():
            try:
                await asyncio.sleep(3600)
            finally:  # like a round withdrawing its declaration
                await release.wait()
                unwound.append(True)

        running = StepControl(loop, scheduled_time=0.0, weight=1.0, require_trigger=False)
        running._start(slow_to_unwind())
        loop.run_until_complete(asyncio.sleep(0.01))
        assert running.cancel() and running.cancel(), "a second cancel must not cut the unwinding short"
        loop.run_until_complete(asyncio.sleep(0.01))
        assert not running.done() and not running.wait_ended(0) and not unwound
        release.set()
        loop.run_until_complete(asyncio.sleep(0.01))
        assert running.cancelled() and running.wait_ended(0) and unwound == [True]
        assert not running.cancel(), "nothing left to cancel"
    finally:
        loop.close()


def test_a_round_started_right_after_a_cancelled_one_waits_for_it_instead_of_failing():
    """The training loop cancels a round and at once schedules the next: the new round must not
    find matchmaking still busy with the old one."""
    dhts = make_swarm(2)
    a, b = (
        DecentralizedAverager([torch.full((8,), float(i))], dht, prefix="again", start=True, **FAST)
        for i, dht in enumerate(dhts)
    )
    try:
        for _ in range(5):
            a.step(wait=False, timeout=20).cancel()
            control_a, control_b = a.step(wait=False, timeout=20), b.step(wait=False, timeout=20)
            assert len(control_a.result(20)) == 2 and len(control_b.result(20)) == 2
    finally:
        close(a, b, *dhts)


@pytest.mark.parametrize("codec", ["BLOCKWISE_8BIT", "BLOCKWISE_4BIT"])
def test_shared_lossy_answers_give_everyone_the_same_values_and_residuals_what_was_lost(codec):
    """With shared_lossy_answers every member ends bit-identical (the quantized average), and each
    member's residuals hold exactly what quantization took from the parts it sent."""
    from plexus.compression import BASE_COMPRESSION_TYPES, CompressionInfo

    compression = BASE_COMPRESSION_TYPES[codec]
    n = 3
    dhts = make_swarm(n)
    local = [
        [torch.randn(5000, generator=torch.Generator().manual_seed(i)), torch.randn(300)] for i in range(n)
    ]
    originals = [[t.clone() for t in tensors] for tensors in local]
    residuals = [[torch.full_like(t, 7.0) for t in tensors] for tensors in local]  # stale: must be reset
    averagers = [
        DecentralizedAverager(
            local[i],
            dht,
            prefix="shared",
            target_group_size=n,
            compression=compression,
            shared_lossy_answers=True,
            compression_residuals=residuals[i],
            part_size_bytes=1024,
            start=True,
            **FAST,
        )
        for i, dht in enumerate(dhts)
    ]
    try:
        for control in [a.step(wait=False, timeout=20) for a in averagers]:
            assert len(control.result()) == n
        for tensors in local[1:]:
            for mine, first in zip(tensors, local[0]):
                assert torch.equal(mine, first), "every member holds the same values"
        exact = [sum(t[k] for t in originals) / n for k in range(2)]
        for k in range(2):
            assert (local[0][k] - exact[k]).norm() / exact[k].norm() < 0.3
        for i in range(n):
            original, residual = torch.cat(originals[i]), torch.cat(residuals[i])
            assert not bool((residual == 7.0).any()), "stale residuals were cleared"
            sent = residual != 0  # parts reduced by others; its own span is used exactly
            assert 0 < int(sent.sum()) < residual.numel()
            decoded = original - residual
            # what the reducers decoded is within the codec's error of what was sent
            info = CompressionInfo.from_tensor(original)
            again = compression.extract(compression.compress(original, info))
            assert (decoded[sent] - original[sent]).abs().max() <= 2 * (again - original).abs().max()
    finally:
        close(*averagers, *dhts)


def test_shared_lossy_answers_refuse_verified_rounds():
    from plexus.averaging.aggregation import RobustAggregation

    (dht,) = make_swarm(1)
    try:
        with pytest.raises(ValueError, match="shared_lossy_answers cannot be verified"):
            DecentralizedAverager(
                [torch.zeros(3)],
                dht,
                prefix="x",
                shared_lossy_answers=True,
                robust=RobustAggregation(verify=True),
            )
        with pytest.raises(ValueError, match="compression_residuals must have the shapes"):
            DecentralizedAverager([torch.zeros(3)], dht, prefix="x", compression_residuals=[torch.zeros(4)])
    finally:
        dht.shutdown()
