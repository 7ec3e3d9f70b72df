"""The older API of the DeDLOC/sahajBERT era: CollaborativeOptimizer and CollaborationState, the
decentralized parameter-averaging optimizers, PerformanceEMA, and a script of that time, unedited."""

import logging
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hivemind import DHT, CollaborativeOptimizer, DecentralizedSGD
from hivemind.optim.collaborative import CollaborationState
from hivemind.optim.performance_ema import PerformanceEMA
from hivemind.proto.runtime_pb2 import CompressionType

from plexus.testing import wait_until

pytestmark = pytest.mark.timeout(90)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "legacy" / "collaborative_mlp.py"


def test_collaboration_state_counts_towards_the_next_step():
    state = CollaborationState(
        optimizer_step=3,
        samples_accumulated=90,
        target_batch_size=100,
        num_peers=2,
        num_clients=0,
        eta_next_step=time.time() + 60,
        next_fetch_time=time.time() + 1,
    )
    assert not state.ready_for_step
    state.samples_accumulated = 100
    assert state.ready_for_step
    state.register_step(4)
    assert state.optimizer_step == 4 and state.samples_accumulated == 0 and not state.ready_for_step


def test_performance_ema_keeps_hiveminds_api():
    ema = PerformanceEMA(alpha=0.5, paused=True)
    with pytest.raises(RuntimeError):
        ema.update(10)  # paused: the interval must be given
    assert ema.update(10, interval=2.0) == pytest.approx(5.0)
    ema.paused = False
    with ema.update_threadsafe(4):
        pass
    assert ema.num_updates == 2 and ema.samples_per_second > 0
    with ema.pause():
        assert ema.paused
    assert not ema.paused


def test_collaborative_optimizer_steps_alone_and_logs_the_old_lines(caplog):
    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    model = torch.nn.Linear(4, 2)
    opt = CollaborativeOptimizer(
        opt=torch.optim.SGD(model.parameters(), lr=0.1),
        dht=dht,
        prefix="solo_run",
        target_batch_size=8,
        batch_size_per_step=4,
        compression_type=CompressionType.Value("FLOAT16"),
        throughput=100.0,
        averaging_expiration=1.0,
        min_refresh_period=0.1,
        max_refresh_period=0.5,
        default_refresh_period=0.2,
        target_group_size=2,
        verbose=True,
        start=True,
    )
    try:
        assert opt.is_synchronized and opt.local_step == 0
        before = model.weight.detach().clone()
        with caplog.at_level(logging.INFO, logger="plexus"):
            while opt.local_step < 2:
                model(torch.randn(4, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
        assert not torch.equal(before, model.weight), "global steps changed the model"
        assert opt.collaboration_state.optimizer_step == 2 and opt.is_synchronized
        assert re.search(
            r"Collaboration accumulated \d+ samples from 1 peers; ETA [\d.]+ seconds "
            r"\(refresh in [\d.]+s\.\)",
            caplog.text,
        )
    finally:
        opt.shutdown()
        dht.shutdown()


def test_decentralized_sgd_averages_parameters_in_the_background(dht_pair):
    params = [torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.full((5,), 10.0))]
    opts = [
        DecentralizedSGD(
            [param], lr=0.0, dht=dht, prefix="dsgd", target_group_size=2, min_matchmaking_time=1.0, timeout=20
        )
        for param, dht in zip(params, dht_pair)
    ]
    try:
        for param, opt in zip(params, opts):  # one local step each wakes each background thread
            param.grad = torch.zeros_like(param)
            opt.step()
        wait_until(lambda: all(opt.rounds_succeeded for opt in opts), timeout=40, message="background rounds")
        for param in params:
            assert torch.allclose(param.detach(), torch.full((5,), 5.0))
    finally:
        for opt in opts:
            opt.shutdown()


@pytest.mark.slow
def test_a_script_of_that_era_runs_unchanged_with_two_peers():
    command = [
        sys.executable,
        "-m",
        "plexus.compat",
        str(EXAMPLE),
        "--max_steps",
        "2",
        "--target_batch_size",
        "32",
        "--wait_for_peers",
        "1",
    ]
    first = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    second, lines = None, []
    try:
        reader = threading.Thread(target=lambda: lines.extend(first.stderr), daemon=True)
        while True:  # the first peer logs where to join before it trains
            line = first.stderr.readline()
            assert line, "the first peer exited early"
            if "--initial_peers" in line:
                break
        address = line.split("--initial_peers", 1)[1].split()
        reader.start()
        second = subprocess.run(
            command + ["--initial_peers", *address, "--seed", "1"], capture_output=True, text=True, timeout=80
        )
        assert second.returncode == 0, second.stderr
        assert "Collaboration accumulated" in second.stderr and "from 2 peers" in second.stderr
        assert re.search(r"Finished at global step 2 of 2", second.stderr)
        assert first.wait(60) == 0
        reader.join(10)
        assert "Finished at global step 2" in "".join(lines)
    finally:
        if first.poll() is None:
            first.kill()


def test_hiveminds_asyncio_helpers_and_mpfuture():
    import asyncio
    import multiprocessing as mp

    from hivemind.utils import MPFuture, amap_in_executor, as_aiter, enter_asynchronously

    async def main():
        first, second = mp.Lock(), mp.Lock()

        async def nested():  # more waiters than a thread pool has threads: none may starve the others
            async with enter_asynchronously(first):
                await asyncio.sleep(0)
                async with enter_asynchronously(second):
                    await asyncio.sleep(0)

        await asyncio.wait_for(asyncio.gather(*(nested() for _ in range(40))), timeout=30)
        sums = [
            x
            async for x in amap_in_executor(
                lambda a, b: a + b, as_aiter(1, 2, 3), as_aiter(10, 20, 30), max_prefetch=2
            )
        ]
        future = MPFuture()
        asyncio.get_running_loop().call_soon(future.set_result, "done")
        return sums, await future, first.acquire(block=False)

    assert asyncio.run(main()) == ([11, 22, 33], "done", True)
