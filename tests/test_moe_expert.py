"""RemoteExpert: outputs and gradients equal the same module run locally; the server trains on backward."""

import copy

import pytest
import torch
from torch import nn

from plexus.compression import CompressionType
from plexus.moe import BatchTensorDescriptor, ExpertInfo, ModuleBackend, RemoteExpert, Server
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


def remote(client: Host, server: Server, uid: str) -> RemoteExpert:
    client.add_addrs(server.host.peer_id, server.host.get_listen_maddrs())
    return RemoteExpert(ExpertInfo(uid, server.host.peer_id), client)


def no_dropout(module: nn.Module) -> nn.Module:
    """Dropout off but training mode kept (eval would switch torch to its inference fast path)."""
    for child in module.modules():
        if isinstance(child, nn.Dropout):
            child.p = 0.0
        if isinstance(child, nn.MultiheadAttention):
            child.dropout = 0.0
    return module


def check_same_as_local(expert: RemoteExpert, local: nn.Module, inputs, atol=1e-5):
    remote_inputs = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    local_inputs = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    output, reference = expert(*remote_inputs), local(*local_inputs)
    torch.testing.assert_close(output, reference, atol=atol, rtol=1e-4)
    weights = torch.randn_like(reference)
    (output * weights).sum().backward()
    (reference * weights).sum().backward()
    for got, want in zip(remote_inputs, local_inputs):
        if want.is_floating_point():
            torch.testing.assert_close(got.grad, want.grad, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("expert_cls, hidden_dim", [("ffn", 16), ("det_dropout", 16), ("transformer", 32)])
def test_gradients_match_the_local_module_and_the_server_learns(expert_cls, hidden_dim, client):
    torch.manual_seed(0)
    uid = f"{expert_cls}.0"
    server = Server.create(
        expert_uids=[uid],
        expert_cls=expert_cls,
        hidden_dim=hidden_dim,
        device="cpu",
        optim_cls=lambda params: torch.optim.SGD(params, lr=0.1),
        start=True,
        host_maddrs=LOCAL,
    )
    try:
        backend = server.module_backends[uid]
        no_dropout(backend.module)
        local = copy.deepcopy(backend.module)
        local_optimizer = torch.optim.SGD(local.parameters(), lr=0.1)
        if expert_cls == "ffn":
            inputs = [torch.randn(5, hidden_dim)]
        elif expert_cls == "det_dropout":
            inputs = [torch.randn(5, hidden_dim), torch.rand(5, hidden_dim) >= 0.2]
        else:
            mask = torch.rand(3, 128) < 0.3
            mask[:, 0] = False  # every sequence keeps at least one position
            inputs = [torch.randn(3, 128, hidden_dim), mask]
        check_same_as_local(remote(client, server, uid), local, inputs)
        local_optimizer.step()  # the server took the same SGD step in its backward
        for name, tensor in local.state_dict().items():
            torch.testing.assert_close(backend.module.state_dict()[name], tensor, atol=1e-5, rtol=1e-4)
    finally:
        server.shutdown()


class ScaleAndCount(nn.Module):
    """Two inputs (one a keyword), two outputs (one an integer): the whole schema machinery."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(2.0))

    def forward(self, x, *, bias):
        return x * self.weight + bias, (x > 0).sum(-1)


def test_keyword_inputs_tuple_outputs_and_the_dummy_trick(client):
    loop = get_background_loop()
    host = loop.run(Host(host_maddrs=LOCAL).start(), 10)
    module = ScaleAndCount()
    backend = ModuleBackend(
        "scale.0",
        module,
        optimizer=torch.optim.SGD(module.parameters(), lr=1.0),
        args_schema=(BatchTensorDescriptor((3,), requires_grad=True),),
        kwargs_schema={"bias": BatchTensorDescriptor((3,), requires_grad=True)},
    )
    assert backend.outputs_schema[1].dtype == "int64" and backend.outputs_tuple
    try:
        with Server(host, {"scale.0": backend}):
            client.add_addrs(host.peer_id, host.get_listen_maddrs())
            expert = RemoteExpert(ExpertInfo("scale.0", host.peer_id), client)
            assert expert.info["keyword_names"] == ("bias",)
            x = torch.tensor([[1.0, -2.0, 3.0]], requires_grad=True)
            bias = torch.ones(1, 3, requires_grad=True)
            scaled, count = expert(x, bias=bias)
            assert torch.equal(scaled, x.detach() * 2 + 1) and count.tolist() == [2]
            assert count.dtype == torch.int64 and not count.requires_grad
            scaled.sum().backward()
            assert torch.equal(x.grad, torch.full((1, 3), 2.0)) and torch.equal(bias.grad, torch.ones(1, 3))
            assert module.weight.item() == pytest.approx(2.0 - 2.0)  # d(sum)/dw = sum(x) = 2, lr 1

            # inputs that need no grad: backward still reaches the server and trains the expert
            before = module.weight.item()
            scaled, _ = expert(torch.ones(2, 3), bias=torch.zeros(2, 3))
            scaled.sum().backward()
            assert module.weight.item() == pytest.approx(before - 6.0)

            with pytest.raises(TypeError, match="keywords \\['bias'\\]"):
                expert(x)
    finally:
        loop.run(host.shutdown(), 10)


def test_large_tensors_stream_in_chunks(client, monkeypatch):
    streamed = []
    original = rpc.call_stream

    def counting_call_stream(host, peer, protocol, *args, **kwargs):
        streamed.append(protocol)
        return original(host, peer, protocol, *args, **kwargs)

    monkeypatch.setattr(rpc, "call_stream", counting_call_stream)
    server = Server.create(
        expert_uids=["nop.0"],
        expert_cls="nop",
        hidden_dim=1024,
        optim_cls=None,
        start=True,
        host_maddrs=LOCAL,
    )
    try:
        expert = remote(client, server, "nop.0")
        x = torch.randn(900, 1024, requires_grad=True)  # 3.7 MB: over the unary limit both ways
        y = expert(x)
        assert torch.equal(y, x.detach())
        (y * 3).sum().backward()
        assert torch.equal(x.grad, torch.full_like(x, 3.0))
        assert streamed == ["/plexus/moe/forward-stream/1.0.0", "/plexus/moe/backward-stream/1.0.0"]
    finally:
        server.shutdown()


def test_compressed_activations(client):
    server = Server.create(
        expert_uids=["ffn.0"],
        hidden_dim=16,
        optim_cls=None,
        start=True,
        host_maddrs=LOCAL,
        compression=CompressionType.FLOAT16,
        device="cpu",
    )  # compared with a CPU input below
    try:
        expert = remote(client, server, "ffn.0")
        assert expert.schema.args_schema[0].compression == CompressionType.FLOAT16
        x = torch.randn(4, 16)
        torch.testing.assert_close(expert(x), server.module_backends["ffn.0"].module(x), atol=1e-2, rtol=1e-2)
    finally:
        server.shutdown()


def test_unknown_expert_fails_on_first_use_with_the_servers_words(client):
    server = Server.create(expert_uids=["ffn.0"], hidden_dim=4, optim_cls=None, start=True, host_maddrs=LOCAL)
    try:
        expert = remote(client, server, "ffn.7")  # constructing it costs nothing and calls nobody
        with pytest.raises(rpc.RPCError, match="no expert 'ffn.7' on this server"):
            expert(torch.randn(1, 4))
    finally:
        server.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_server_on_cuda_matches_the_local_module(client):
    server = Server.create(
        expert_uids=["ffn.0"],
        hidden_dim=16,
        device="cuda",
        optim_cls=lambda params: torch.optim.SGD(params, lr=0.1),
        start=True,
        host_maddrs=LOCAL,
    )
    try:
        backend = server.module_backends["ffn.0"]
        assert backend.device.type == "cuda"
        local = copy.deepcopy(backend.module).cpu()
        check_same_as_local(remote(client, server, "ffn.0"), local, [torch.randn(5, 16)], atol=1e-4)
    finally:
        server.shutdown()
