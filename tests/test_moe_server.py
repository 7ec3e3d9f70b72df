"""Expert server: batching runtime, built-in experts, checkpoints, and requests that must be refused."""

import asyncio
import os
import random
import threading
import time

import pytest
import torch

from plexus.compression import serialize_torch_tensor
from plexus.dht.dht import DHT
from plexus.moe import (
    BatchTensorDescriptor,
    ExpertInfo,
    ModuleBackend,
    RemoteExpert,
    Server,
    background_server,
)
from plexus.moe.client import expert_forward
from plexus.moe.messages import (
    BACKWARD_PROTOCOL,
    FORWARD_PROTOCOL,
    FORWARD_STREAM_PROTOCOL,
    INFO_PROTOCOL,
    ExpertRequest,
    ExpertResponse,
    ExpertSchema,
    InfoRequest,
)
from plexus.moe.server.checkpoints import LAST, load_experts, save_expert
from plexus.moe.server.layers import name_to_block
from plexus.moe.server.runtime import Runtime, TaskPool, TaskRejected
from plexus.p2p import rpc
from plexus.p2p.host import Host
from plexus.utils.background_loop import get_background_loop

pytestmark = pytest.mark.timeout(30)
LOCAL = ("/ip4/127.0.0.1/tcp/0",)


@pytest.fixture(scope="module")
def client():
    loop = get_background_loop()
    host = loop.run(Host(host_maddrs=()).start(), 10)
    yield host
    loop.run(host.shutdown(), 10)


def connect(client: Host, server: Server) -> None:
    client.add_addrs(server.host.peer_id, server.host.get_listen_maddrs())


# --- the runtime ------------------------------------------------------------------------------------


class Recorder:
    """A pool function that records each batch and doubles its input."""

    def __init__(self, name):
        self.name, self.batches = name, []

    def __call__(self, x):
        self.batches.append((self.name, x[:, 0].tolist()))
        return (x * 2,)


def run_with_runtime(pools, body, *, start_after_submit=True):
    """Run `body(submit)` on a fresh loop with a runtime over `pools`, started after the first submissions."""
    runtime = Runtime(pools)

    async def main():
        if not start_after_submit:
            runtime.start()
        return await body(runtime)

    try:
        return asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        runtime.shutdown()


def rows(*values):
    return torch.tensor(values, dtype=torch.float32)[:, None]


def test_batches_stay_within_max_batch_size_and_keep_arrival_order():
    record = Recorder("a")
    pool = TaskPool(record, name="a", max_batch_size=4)

    async def body(runtime):
        futures = [pool.submit_task(rows(*[i] * size)) for i, size in enumerate([3, 1, 2, 4, 1])]
        with pytest.raises(TaskRejected, match="exceeds max_batch_size=4"):
            pool.submit_task(rows(*range(5)))
        with pytest.raises(TaskRejected, match="share one batch size"):
            pool.submit_task(rows(1, 2), rows(1))
        runtime.start()
        results = await asyncio.gather(*futures)
        for i, (size, (output,)) in enumerate(zip([3, 1, 2, 4, 1], results)):
            assert torch.equal(output, rows(*[2 * i] * size))

    run_with_runtime([pool], body)
    assert [len(values) for _, values in record.batches] == [4, 2, 4, 1]
    assert [v for _, values in record.batches for v in values] == [0, 0, 0, 1, 2, 2, 3, 3, 3, 3, 4]


def test_oldest_waiting_request_goes_first_across_pools():
    seen = []
    lock = threading.Lock()

    def make(name):
        def process(x):
            with lock:
                seen.append((name, int(x[0, 0])))
            return (x,)

        return process

    pool_a = TaskPool(make("a"), name="a", max_batch_size=1)
    pool_b = TaskPool(make("b"), name="b", max_batch_size=1)

    async def body(runtime):
        futures = [
            pool_b.submit_task(rows(1)),
            pool_a.submit_task(rows(2)),
            pool_b.submit_task(rows(3)),
            pool_a.submit_task(rows(4)),
            pool_a.submit_task(rows(5)),
        ]
        runtime.start()
        await asyncio.gather(*futures)

    run_with_runtime([pool_a, pool_b], body)
    assert seen == [("b", 1), ("a", 2), ("b", 3), ("a", 4), ("a", 5)]


def test_min_batch_size_waits_for_rows_then_gives_up_after_timeout():
    patient, impatient = Recorder("patient"), Recorder("impatient")
    patient_pool = TaskPool(patient, name="patient", max_batch_size=8, min_batch_size=4, timeout=10.0)
    impatient_pool = TaskPool(impatient, name="impatient", max_batch_size=8, min_batch_size=4, timeout=0.3)

    async def body(runtime):
        first = patient_pool.submit_task(rows(1))
        await asyncio.sleep(0.05)  # far inside the 10 s timeout: the lone row must still be waiting
        assert not first.done()
        second = patient_pool.submit_task(rows(2, 2, 2))
        await asyncio.gather(first, second)
        started = time.monotonic()
        await impatient_pool.submit_task(rows(3))  # alone below the minimum: runs once its timeout passes
        assert time.monotonic() - started >= 0.25

    run_with_runtime([patient_pool, impatient_pool], body, start_after_submit=False)
    assert patient.batches == [("patient", [1, 2, 2, 2])]
    assert impatient.batches == [("impatient", [3])]


def test_different_shapes_are_not_concatenated_and_errors_reach_only_their_batch():
    def process(x):
        if x.shape[1] == 3:
            raise ValueError("three columns are not welcome")
        return (x + 1,)

    pool = TaskPool(process, name="p", max_batch_size=16)

    async def body(runtime):
        good = pool.submit_task(torch.zeros(2, 2))
        bad = pool.submit_task(torch.zeros(2, 3))
        cancelled = pool.submit_task(torch.zeros(1, 2))
        cancelled.cancel()
        also_good = pool.submit_task(torch.zeros(1, 2))
        runtime.start()
        assert torch.equal((await good)[0], torch.ones(2, 2))
        with pytest.raises(ValueError, match="three columns"):
            await bad
        assert torch.equal((await also_good)[0], torch.ones(1, 2))
        job = runtime.submit_job(threading.current_thread)
        assert (await asyncio.wrap_future(job)).name == "plexus-moe-runtime"

    run_with_runtime([pool], body)


def test_pending_requests_are_bounded_and_failed_on_shutdown():
    pool = TaskPool(lambda x: (x,), name="p", max_batch_size=4, max_pending_tasks=2)
    runtime = Runtime([pool])

    async def main():
        waiting = [pool.submit_task(rows(1)), pool.submit_task(rows(2))]
        with pytest.raises(TaskRejected, match="overloaded"):
            pool.submit_task(rows(3))
        runtime.shutdown()
        for future in waiting:
            with pytest.raises(ConnectionAbortedError, match="shutting down"):
                await future
        with pytest.raises(TaskRejected, match="shutting down"):
            pool.submit_task(rows(4))

    asyncio.run(asyncio.wait_for(main(), 10))


# --- servers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("expert_cls", sorted(name_to_block))
def test_each_builtin_expert_starts_and_answers(expert_cls, client):
    with background_server(
        expert_uids=[f"{expert_cls}.0"], expert_cls=expert_cls, hidden_dim=16, optim_cls=None
    ) as info:
        client.add_addrs(info.peer_id, info.addrs)
        expert = RemoteExpert(ExpertInfo(f"{expert_cls}.0", info.peer_id), client)
        inputs = [
            d.make_zeros(2) + (torch.randn(2, *d.make_zeros(1).shape[1:]) if d.requires_grad else 0)
            for d in expert.schema.args_schema
        ]
        if expert_cls == "transformer":
            inputs[1] = torch.zeros(2, 128, dtype=torch.bool)
        if expert_cls == "det_dropout":
            inputs[1] = torch.ones(2, 16, dtype=torch.bool)
        output = expert(*inputs)
        assert output.shape == inputs[0].shape and torch.isfinite(output).all()


def test_server_refuses_what_cannot_serve():
    backend = ModuleBackend("ffn.0", torch.nn.Linear(4, 4), args_schema=(BatchTensorDescriptor((4,)),))
    with pytest.raises(TypeError, match="started plexus.DHT or plexus.p2p.Host"):
        Server(object(), {"ffn.0": backend}, start=True)
    with DHT(start=True, client_mode=True) as dht, pytest.raises(ValueError, match="client_mode"):
        Server(dht, {"ffn.0": backend})


def test_create_chooses_uids():
    server = Server.create(
        num_experts=3,
        expert_pattern="ffn.[0:2].[0:8]",
        hidden_dim=4,
        start=False,
        rng=random.Random(0),
        host=Host(),
    )
    assert len(server.module_backends) == 3 and all(uid.startswith("ffn.") for uid in server.module_backends)
    server = Server.create(num_experts=2, hidden_dim=4, optim_cls=None, start=False, host=Host())
    assert list(server.module_backends) == ["expert.0", "expert.1"]
    with pytest.raises(ValueError, match="invalid expert uids"):
        Server.create(expert_uids=["no_coordinates"], hidden_dim=4, start=False, host=Host())
    with pytest.raises(ValueError, match="unknown expert class"):
        Server.create(num_experts=1, expert_cls="nope", start=False, host=Host())
    with pytest.raises(ValueError, match="needs num_warmup_steps"):
        Server.create(num_experts=1, hidden_dim=4, scheduler="linear", start=False, host=Host())


def test_checkpoints_are_saved_atomically_and_restored(tmp_path, client):
    uid = "ffn.0"
    server = Server.create(
        expert_uids=[uid],
        hidden_dim=8,
        optim_cls=lambda p: torch.optim.Adam(p, lr=0.01),
        scheduler="linear",
        num_warmup_steps=2,
        num_training_steps=10,
        checkpoint_dir=tmp_path,
        update_period=0.2,
        start=True,
        host_maddrs=LOCAL,
    )
    try:
        connect(client, server)
        expert = RemoteExpert(ExpertInfo(uid, server.host.peer_id), client)
        for _ in range(3):
            expert(torch.randn(4, 8)).sum().backward()  # trains: three optimizer and scheduler steps
        deadline = time.monotonic() + 10
        while not (tmp_path / uid / LAST).exists():  # the periodic save
            assert time.monotonic() < deadline, "no periodic checkpoint within 10 s"
            time.sleep(0.05)
    finally:
        server.shutdown()  # saves once more
    trained = server.module_backends[uid]
    files = sorted(p.name for p in (tmp_path / uid).iterdir())
    assert LAST in files and any(name.startswith("checkpoint_2") for name in files)
    assert not [name for name in files if name.endswith(".tmp")]

    restored = Server.create(
        num_experts=1,
        hidden_dim=8,
        optim_cls=lambda p: torch.optim.Adam(p, lr=0.01),
        scheduler="linear",
        num_warmup_steps=2,
        num_training_steps=10,
        checkpoint_dir=tmp_path,
        start=False,
        host=Host(),
    )
    assert list(restored.module_backends) == [uid]  # the uid came from the checkpoint directory
    backend = restored.module_backends[uid]
    load_experts(restored.module_backends, tmp_path)
    for name, tensor in trained.module.state_dict().items():
        assert torch.equal(tensor, backend.module.state_dict()[name]), name
    assert backend.scheduler.last_epoch == trained.scheduler.last_epoch == 3
    assert backend.optimizer.state_dict()["state"][0]["step"] == 3


def test_checkpoint_files_are_bounded_and_bad_files_explained(tmp_path):
    backend = ModuleBackend("ffn.1", torch.nn.Linear(2, 2), args_schema=(BatchTensorDescriptor((2,)),))
    for _ in range(7):
        save_expert(backend, tmp_path, keep_last=3)
    names = sorted(os.listdir(tmp_path / "ffn.1"))
    assert len(names) == 4 and LAST in names
    assert os.path.realpath(tmp_path / "ffn.1" / LAST) == str(tmp_path / "ffn.1" / names[-2])
    (tmp_path / "ffn.1" / LAST).unlink()
    (tmp_path / "ffn.1" / LAST).write_bytes(b"not a checkpoint")
    with pytest.raises(RuntimeError, match="Move the file away"):
        load_experts({"ffn.1": backend}, tmp_path)
    with pytest.raises(ValueError, match="cannot name a checkpoint directory"):
        save_expert(
            ModuleBackend("..", torch.nn.Linear(2, 2), args_schema=(BatchTensorDescriptor((2,)),)), tmp_path
        )


# --- malformed requests -----------------------------------------------------------------------------


def tensor_bytes(tensor):
    return serialize_torch_tensor(tensor).to_bytes()


def test_malformed_requests_get_errors_and_the_server_keeps_serving(client):
    loop = get_background_loop()
    server = Server.create(
        expert_uids=["ffn.0"], hidden_dim=4, max_batch_size=8, optim_cls=None, start=True, host_maddrs=LOCAL
    )
    connect(client, server)
    peer = server.host.peer_id

    async def call(protocol, request, response_type=ExpertResponse, timeout=10):
        return await rpc.call(client, peer, protocol, request, response_type, timeout=timeout)

    async def stream(messages):
        async def requests():
            for message in messages:
                yield message

        return [
            r
            async for r in rpc.call_stream(
                client, peer, FORWARD_STREAM_PROTOCOL, requests(), ExpertResponse, timeout=10
            )
        ]

    good = ExpertRequest("ffn.0", [tensor_bytes(torch.randn(2, 4))])
    header_of_wrong_shape = serialize_torch_tensor(torch.randn(2, 5)).to_bytes()
    cases = [
        (lambda: call(FORWARD_PROTOCOL, b"\xc1garbage"), "malformed ExpertRequest"),
        (lambda: call(FORWARD_PROTOCOL, ExpertRequest("ffn.9", good.tensors)), "no expert 'ffn.9'"),
        (lambda: call(INFO_PROTOCOL, InfoRequest("ffn.9"), ExpertSchema), "no expert 'ffn.9'"),
        (
            lambda: call(FORWARD_PROTOCOL, ExpertRequest("ffn.0", [tensor_bytes(torch.randn(2, 5))])),
            r"input 0 has shape \(2, 5\), expected \(batch, 4\)",
        ),
        (
            lambda: call(
                FORWARD_PROTOCOL, ExpertRequest("ffn.0", [tensor_bytes(torch.randn(2, 4).double())])
            ),
            "dtype float64, expected float32",
        ),
        (
            lambda: call(FORWARD_PROTOCOL, ExpertRequest("ffn.0", good.tensors * 2)),
            "takes 1 tensors for forward, got 2",
        ),
        (
            lambda: call(FORWARD_PROTOCOL, ExpertRequest("ffn.0", [tensor_bytes(torch.randn(9, 4))])),
            "more than max_batch_size=8",
        ),
        (
            lambda: call(FORWARD_PROTOCOL, ExpertRequest("ffn.0", [tensor_bytes(torch.randn(0, 4))])),
            "empty batch",
        ),
        (lambda: call(FORWARD_PROTOCOL, ExpertRequest("ffn.0", [b"\x96\xc4\x01x"])), "malformed tensor"),
        (lambda: call(BACKWARD_PROTOCOL, good), "takes 2 tensors for backward, got 1"),
        (
            lambda: call(
                BACKWARD_PROTOCOL, ExpertRequest("ffn.0", [good.tensors[0], tensor_bytes(torch.randn(3, 4))])
            ),
            "output gradient 0 has 3 rows, but the first tensor has 2",
        ),
        (lambda: stream([ExpertRequest("ffn.0", [header_of_wrong_shape])]), "input 0 has shape"),
        (
            lambda: stream([ExpertRequest("ffn.0", []), ExpertRequest("ffn.1", good.tensors)]),
            "switched to 'ffn.1'",
        ),
        (lambda: stream([]), "stream was empty"),
        (
            lambda: stream([ExpertRequest("ffn.0", [serialize_torch_tensor(torch.randn(9, 4)).to_bytes()])]),
            "more than max_batch_size=8",
        ),
        (lambda: stream([ExpertRequest("ffn.0", [])]), "takes 1 tensors for forward, got 0"),
    ]
    try:
        for make_call, message in cases:
            with pytest.raises(rpc.RPCError, match=message):
                loop.run(make_call(), 15)
            response = loop.run(call(FORWARD_PROTOCOL, good), 15)  # still serving
            assert len(response.tensors) == 1
        # A frame over the 4 MiB limit is refused by the RPC layer from its header, before its body is read:
        # the caller gets the error at once (no timeout), and the server serves on.
        with pytest.raises(rpc.RPCError, match="exceeds the 4194304-byte limit"):
            loop.run(call(FORWARD_PROTOCOL, ExpertRequest("ffn.0", [b"x" * (5 << 20)]), timeout=10), 15)
        with pytest.raises(rpc.RPCError, match="exceeds the 4194304-byte limit"):
            loop.run(stream([ExpertRequest("ffn.0", [b"x" * (5 << 20)])]), 15)
        assert len(loop.run(call(FORWARD_PROTOCOL, good), 15).tensors) == 1
    finally:
        server.shutdown()


def test_slow_expert_times_out_with_a_clear_error(client):
    server = Server.create(
        expert_uids=["nop_delay.0"],
        expert_cls="nop_delay",
        hidden_dim=4,
        optim_cls=None,
        start=True,
        host_maddrs=LOCAL,
        request_timeout=0.1,
    )
    try:
        connect(client, server)
        expert = RemoteExpert(ExpertInfo("nop_delay.0", server.host.peer_id), client)
        with pytest.raises(rpc.RPCError, match="request_timeout of 0.1 s"):
            expert(torch.randn(1, 4))
    finally:
        server.shutdown()


class Gated(torch.nn.Module):
    """Holds the compute thread inside forward until the test opens the gate; records batch sizes."""

    def __init__(self):
        super().__init__()
        self.entered, self.gate, self.batch_sizes = threading.Event(), threading.Event(), []

    def forward(self, x):
        self.batch_sizes.append(x.shape[0])
        self.entered.set()
        assert self.gate.wait(20), "the test never opened the gate"
        return x + 1


def test_busy_compute_thread_leaves_the_loop_free_and_waiting_requests_share_a_batch(client):
    loop = get_background_loop()
    host = loop.run(Host(host_maddrs=LOCAL).start(), 10)
    module = Gated()
    module.gate.set()  # let the schema inference through
    backend = ModuleBackend("gated.0", module, args_schema=(BatchTensorDescriptor((2,)),))
    module.gate.clear()
    module.entered.clear()
    module.batch_sizes.clear()
    try:
        with Server(host, {"gated.0": backend}):
            client.add_addrs(host.peer_id, host.get_listen_maddrs())
            expert = RemoteExpert(ExpertInfo("gated.0", host.peer_id), client)
            expert.schema  # noqa: B018  (fetch it now, outside the measured part)

            async def forward(value):
                return await expert_forward(
                    client, expert.expert_info, expert.schema, [torch.full((2, 2), value)]
                )

            first = loop.submit(forward(0.0))
            assert module.entered.wait(10)  # the compute thread is now stuck in forward
            waiting = [loop.submit(forward(float(v))) for v in range(1, 6)]
            # the loop still answers: a schema request completes while compute is blocked
            schema = loop.run(
                rpc.call(
                    client, host.peer_id, INFO_PROTOCOL, InfoRequest("gated.0"), ExpertSchema, timeout=10
                ),
                15,
            )
            assert schema.uid == "gated.0" and not first.done()
            deadline = time.monotonic() + 10
            while backend.forward_pool.num_pending < 5:  # all five reached the pool
                assert time.monotonic() < deadline
                time.sleep(0.01)
            module.gate.set()
            assert first.result(10)[0][:, 0].tolist() == [1, 1]
            for value, future in zip(range(1, 6), waiting):
                assert future.result(10)[0][:, 0].tolist() == [value + 1] * 2
            assert module.batch_sizes == [2, 10]  # the five waiting requests ran as one batch
    finally:
        module.gate.set()
        loop.run(host.shutdown(), 10)
