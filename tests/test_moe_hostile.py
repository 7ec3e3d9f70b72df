"""Hostile callers of an expert server: compute shared fairly between peers, a flooding peer
bounded and refused while others are served, and garbage on the streaming forward and backward."""

import asyncio
import threading
import time

import pytest
import torch

from plexus.compression import serialize_torch_tensor, split_for_streaming
from plexus.moe import BatchTensorDescriptor, ExpertInfo, ModuleBackend, Server
from plexus.moe.client import expert_backward, expert_forward
from plexus.moe.messages import (
    BACKWARD_STREAM_PROTOCOL,
    FORWARD_PROTOCOL,
    FORWARD_STREAM_PROTOCOL,
    ExpertRequest,
    ExpertResponse,
)
from plexus.moe.server.runtime import Runtime, TaskPool
from plexus.p2p import rpc
from plexus.p2p.host import Host
from plexus.utils.background_loop import get_background_loop
from plexus.utils.timing import ManualClock

pytestmark = pytest.mark.timeout(60)
LOCAL = ("/ip4/127.0.0.1/tcp/0",)
HIDDEN = 4


# --- fair shares in the runtime, without a network ---------------------------------------------------


class Gate:
    """A pool function held until released, one batch at a time; records who was in each batch.
    Each batch "takes" one millisecond per row of `clock` (the runtime's), whatever the wall time."""

    def __init__(self, clock: ManualClock):
        self.clock, self.batches = clock, []
        self.entered, self.release = threading.Semaphore(0), threading.Semaphore(0)

    def __call__(self, x):
        self.batches.append(x[:, 0].tolist())
        self.entered.release()
        assert self.release.acquire(timeout=20), "the test never released the batch"
        self.clock.advance(1e-3 * x.shape[0])
        return (x,)

    def step(self):
        """Let the batch in progress finish; wait until the next one starts."""
        self.release.release()
        assert self.entered.acquire(timeout=20)


def rows(value, count=1):
    return torch.full((count, 1), float(value))


def run(body, *pools):
    runtime = Runtime(list(pools), clock=pools[0].process_func.clock)
    runtime.start()
    try:
        return asyncio.run(asyncio.wait_for(body(), 30))
    finally:
        for gate in {pool.process_func for pool in pools}:
            for _ in range(100):
                gate.release.release()
        runtime.shutdown()


def test_a_flooding_owner_waits_behind_its_own_requests_not_in_front_of_others():
    clock = ManualClock(0.0)
    gate = Gate(clock)
    pool = TaskPool(gate, name="p", max_batch_size=4, clock=clock)

    async def body():
        flood = [pool.submit_task(rows(1, 4), owner="flooder") for _ in range(20)]
        assert await asyncio.to_thread(gate.entered.acquire, True, 20)  # the first flood batch is running
        honest = pool.submit_task(rows(2), owner="honest")
        await asyncio.to_thread(gate.step)  # the running batch ends; the next one starts
        assert gate.batches[-1] == [2.0]  # the honest request, not 19 flood batches first
        await asyncio.to_thread(gate.step)
        await honest
        assert sum(not future.done() for future in flood) >= 17
        for _ in flood:
            gate.release.release()
        await asyncio.gather(*flood)

    run(body, pool)


def test_fair_shares_hold_across_pools_and_alternate_between_busy_owners():
    clock = ManualClock(0.0)
    gate = Gate(clock)
    big = TaskPool(gate, name="big", max_batch_size=4, clock=clock)
    small = TaskPool(gate, name="small", max_batch_size=4, clock=clock)

    async def body():
        flood = [big.submit_task(rows(1, 4), owner="flooder") for _ in range(10)]
        assert await asyncio.to_thread(gate.entered.acquire, True, 20)
        other = [small.submit_task(rows(2, 4), owner="other") for _ in range(3)]  # another expert's pool
        for _ in range(6):
            await asyncio.to_thread(gate.step)
        # after the batch that was running, the two busy owners take turns: their batches take as long
        assert [batch[0] for batch in gate.batches[1:7]] == [2.0, 1.0, 2.0, 1.0, 2.0, 1.0]
        for _ in range(20):
            gate.release.release()
        await asyncio.gather(*flood, *other)

    run(body, big, small)


def test_small_requests_of_several_owners_share_a_batch():
    clock = ManualClock(0.0)
    gate = Gate(clock)
    pool = TaskPool(gate, name="p", max_batch_size=8, clock=clock)

    async def body():
        blocker = pool.submit_task(rows(0), owner="a")
        assert await asyncio.to_thread(gate.entered.acquire, True, 20)
        waiting = [pool.submit_task(rows(owner, 2), owner=owner) for owner in (1, 1, 1, 2, 3)]
        await asyncio.to_thread(gate.step)
        assert sorted(gate.batches[1]) == [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]  # rows of all three owners
        for _ in range(2):  # this batch, and the one with owner 1's third request
            gate.release.release()
        await asyncio.gather(blocker, *waiting)

    run(body, pool)


# --- a server under attack ---------------------------------------------------------------------------


MARK = 12345.0  # rows of this value are the honest client's


class Slow(torch.nn.Module):
    """Stands for real compute: each batch takes a few milliseconds of the compute thread. Records,
    per batch it started, whether the batch held a marked row."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)
        self.marked: list[bool] = []

    def forward(self, x):
        self.marked.append(bool((x == MARK).all(dim=1).any()))
        time.sleep(0.005)  # simulated compute time, not synchronisation
        return self.linear(x)


@pytest.fixture(scope="module")
def server():
    loop = get_background_loop()
    host = loop.run(Host(host_maddrs=LOCAL).start(), 10)
    schema = (BatchTensorDescriptor((HIDDEN,), requires_grad=True),)
    backend = ModuleBackend("slow.0", Slow(), args_schema=schema, max_batch_size=8)
    with Server(host, {"slow.0": backend}, max_requests_per_peer=16) as running:
        yield running
    loop.run(host.shutdown(), 10)


def client_host(server) -> Host:
    host = get_background_loop().run(Host(host_maddrs=()).start(), 10)
    host.add_addrs(server.host.peer_id, server.host.get_listen_maddrs())
    return host


def test_a_flood_from_one_peer_is_bounded_and_others_are_served_meanwhile(server, caplog):
    loop = get_background_loop()
    flooder, honest = client_host(server), client_host(server)
    expert = ExpertInfo("slow.0", server.host.peer_id)
    schema = server.module_backends["slow.0"].schema
    pool = server.module_backends["slow.0"].forward_pool

    async def attack_and_measure():
        stop, outcomes = asyncio.Event(), []

        async def flood_one():  # 200 of these: a request of the largest size, again and again
            while not stop.is_set():
                try:
                    await expert_forward(flooder, expert, schema, [torch.randn(8, HIDDEN)], timeout=30)
                    outcomes.append("served")
                except rpc.RPCError as error:
                    assert "too many calls from you under way" in str(error)
                    outcomes.append("refused")
                    await asyncio.sleep(0.01)  # the attacker's pace after a refusal, not synchronisation

        flood = [asyncio.ensure_future(flood_one()) for _ in range(200)]
        while pool.num_pending < 8:  # the flood has reached the queue
            await asyncio.sleep(0.005)  # polling with a deadline (the test's timeout) for the flood
        answers = []
        for _ in range(5):
            marked = [torch.full((1, HIDDEN), MARK)]
            outputs = await expert_forward(honest, expert, schema, marked, timeout=30)
            started, waiting = queued[-1]
            ran = next(index for index in range(started, len(slow.marked)) if slow.marked[index])
            answers.append((outputs[0].shape, waiting, ran - started))
        stop.set()
        await asyncio.gather(*flood)
        return answers, outcomes

    # for each honest request, the batches started before it entered the queue, and the flood
    # requests waiting there with it
    slow, queued, submit = server.module_backends["slow.0"].module, [], pool.submit_task

    def submit_and_watch(*inputs, owner=None):
        if owner == honest.peer_id:
            queued.append((len(slow.marked), pool.num_pending))
        return submit(*inputs, owner=owner)

    pool.submit_task = submit_and_watch
    try:
        answers, outcomes = loop.run(attack_and_measure(), 50)
        assert all(shape == (1, HIDDEN) for shape, _, _ in answers)
        # each honest request found flood requests queued, yet ran in the next batch or the one after
        # (the flooder's earlier ones first once, on a tie): not after every flood request queued
        assert all(batches_first <= 1 for _, _, batches_first in answers), answers
        assert max(waiting for _, waiting, _ in answers) >= 3, answers  # there were requests to jump
        assert outcomes.count("refused") >= 200 - 16 and outcomes.count("served") >= 16
        assert server.handler._under_way == {}  # every admitted call was let go again
        assert "max_requests_per_peer=16" in caplog.text  # logged (once a minute per peer)
        # the flood is over: the flooder is served again
        again = loop.run(expert_forward(flooder, expert, schema, [torch.randn(2, HIDDEN)]), 20)
        assert again[0].shape == (2, HIDDEN)
    finally:
        pool.submit_task = submit
        for host in (flooder, honest):
            loop.run(host.shutdown(), 10)


def chunks(tensor, chunk_bytes=16):
    return [chunk.to_bytes() for chunk in split_for_streaming(serialize_torch_tensor(tensor), chunk_bytes)]


@pytest.mark.parametrize("protocol", [FORWARD_STREAM_PROTOCOL, BACKWARD_STREAM_PROTOCOL])
def test_streams_refuse_garbage_oversized_and_wrong_inputs_and_keep_serving(server, protocol):
    loop = get_background_loop()
    client = client_host(server)
    peer, backward = server.host.peer_id, protocol == BACKWARD_STREAM_PROTOCOL
    x, grad = torch.randn(2, HIDDEN), torch.randn(2, HIDDEN)
    good = [*chunks(x), *chunks(grad)] if backward else chunks(x)
    expected = 2 if backward else 1

    async def stream(messages):
        async def requests():
            for message in messages:
                yield message

        responses = rpc.call_stream(client, peer, protocol, requests(), ExpertResponse, timeout=10)
        return [response async for response in responses]

    header, *rest = chunks(torch.randn(2, HIDDEN))
    cases = [
        ([b"\xc1 not msgpack"], "malformed ExpertRequest"),
        ([ExpertRequest("slow.9", good)], "no expert 'slow.9'"),
        ([ExpertRequest("slow.0", [b"\x96\xc4\x01x"])], "malformed tensor stream"),
        ([ExpertRequest("slow.0", chunks(torch.randn(9, HIDDEN)))], "more than max_batch_size=8"),
        (
            [ExpertRequest("slow.0", chunks(torch.randn(2, HIDDEN).double()))],
            "dtype float64, expected float32",
        ),
        ([ExpertRequest("slow.0", chunks(torch.randn(2, HIDDEN + 1)))], r"input 0 has shape \(2, 5\)"),
        ([ExpertRequest("slow.0", chunks(torch.randn(2, HIDDEN)) * 3)], f"takes {expected} tensors"),
        ([ExpertRequest("slow.0", good[:1])], "malformed tensor stream"),  # a header whose data never comes
        # more data than the header declared
        ([ExpertRequest("slow.0", [header, *rest, *rest])], "malformed tensor stream"),
        ([ExpertRequest("slow.0", good[:3]), ExpertRequest("slow.1", good[3:])], "switched to 'slow.1'"),
    ]
    if backward:
        cases += [
            ([ExpertRequest("slow.0", chunks(x))], "takes 2 tensors for backward, got 1"),
            (
                [ExpertRequest("slow.0", [*chunks(x), *chunks(torch.randn(3, HIDDEN))])],
                "output gradient 0 has 3 rows, but the first tensor has 2",
            ),
            (
                [ExpertRequest("slow.0", [*chunks(x), *chunks(grad.to(torch.int64))])],
                "output gradient 0 has dtype int64",
            ),
        ]
    expert = ExpertInfo("slow.0", peer)
    schema = server.module_backends["slow.0"].schema
    try:
        for messages, message in cases:
            with pytest.raises(rpc.RPCError, match=message):
                loop.run(stream(messages), 15)
            # still serving, the stream of this kind included
            assert len(loop.run(stream([ExpertRequest("slow.0", good)]), 15)) >= 1
        if backward:
            grads = loop.run(expert_backward(client, expert, schema, [x], [grad]), 15)
            assert grads[0].shape == (2, HIDDEN)
        else:
            assert loop.run(expert_forward(client, expert, schema, [x]), 15)[0].shape == (2, HIDDEN)
        # a frame over the RPC limit gets an error or is dropped; the server serves on
        with pytest.raises((rpc.RPCError, TimeoutError)):
            loop.run(
                rpc.call(
                    client,
                    peer,
                    FORWARD_PROTOCOL,
                    ExpertRequest("slow.0", [b"x" * (5 << 20)]),
                    ExpertResponse,
                    timeout=2,
                ),
                15,
            )
        assert loop.run(expert_forward(client, expert, schema, [x]), 15)[0].shape == (2, HIDDEN)
    finally:
        loop.run(client.shutdown(), 10)
