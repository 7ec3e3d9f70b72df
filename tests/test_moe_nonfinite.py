"""An expert server never trains on, nor answers with, NaN or inf: such requests are refused with a
clear error, the expert's parameters stay exactly as they were, and honest calls keep working."""

import copy
import logging

import pytest
import torch
from torch import nn

from plexus.moe import BatchTensorDescriptor, ModuleBackend, Server
from plexus.moe.client.expert import expert_backward
from plexus.moe.server import handler
from plexus.moe.server.module_backend import NonFiniteError
from plexus.p2p import rpc
from plexus.utils.background_loop import get_background_loop
from plexus.utils.logging import RateLimitedLog
from tests.test_moe_expert import LOCAL, client, remote  # noqa: F401  (client is a fixture)

pytestmark = pytest.mark.timeout(30)


def SGD(params):
    return torch.optim.SGD(params, lr=0.1)


def parameters_of(server: Server, uid: str) -> list[torch.Tensor]:
    return [p.detach().clone() for p in server.module_backends[uid].module.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("poison", ["grad_outputs", "inputs", "few_elements"])
def test_a_nonfinite_backward_is_refused_and_the_expert_unchanged(
    client,  # noqa: F811 (the fixture imported above)
    poison,
    caplog,
    monkeypatch,
):
    monkeypatch.setattr(handler, "_refusals", RateLimitedLog(handler.logger))  # a fresh once-a-minute log
    caplog.set_level(logging.WARNING, logger="plexus.moe")
    server = Server.create(
        expert_uids=["ffn.0"], hidden_dim=8, optim_cls=SGD, start=True, host_maddrs=LOCAL, device="cpu"
    )
    try:
        expert = remote(client, server, "ffn.0")
        before = parameters_of(server, "ffn.0")
        inputs, grad_outputs = [torch.randn(4, 8)], [torch.ones(4, 8)]
        if poison == "grad_outputs":
            grad_outputs[0].fill_(float("nan"))
        elif poison == "few_elements":
            grad_outputs[0][0, :2] = float("inf")
        else:  # the inputs the backward reruns the forward on
            inputs[0][1, 3] = float("nan")
        with pytest.raises(rpc.RPCError, match="NaN or inf; the request was refused"):
            get_background_loop().run(
                expert_backward(client, expert.expert_info, expert.schema, inputs, grad_outputs), 20
            )
        assert same(parameters_of(server, "ffn.0"), before), "not one parameter moved"
        messages = [record.getMessage() for record in caplog.records]
        assert any("refused a request" in m and "NaN or inf" in m for m in messages)
        honest = torch.randn(4, 8, requires_grad=True)
        out = expert(honest)
        out.sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(honest.grad).all()
        after = parameters_of(server, "ffn.0")
        assert not same(after, before), "honest calls still train"
        assert all(torch.isfinite(p).all() for p in after)
    finally:
        server.shutdown()


def test_a_nonfinite_forward_input_is_refused(client):  # noqa: F811
    server = Server.create(
        expert_uids=["ffn.0"], hidden_dim=8, optim_cls=SGD, start=True, host_maddrs=LOCAL, device="cpu"
    )
    try:
        expert = remote(client, server, "ffn.0")
        with pytest.raises(rpc.RPCError, match="input 0 holds NaN or inf"):
            expert(torch.full((2, 8), float("nan")))
        assert torch.isfinite(expert(torch.randn(2, 8))).all()
    finally:
        server.shutdown()


def test_finite_inputs_that_overflow_are_refused_and_train_nothing():
    """Overflow inside the expert: outputs or gradients become inf although every input is finite."""
    module = nn.Linear(4, 4)
    with torch.no_grad():
        module.weight.fill_(1.0)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    backend = ModuleBackend("big", module, optimizer=optimizer, args_schema=(BatchTensorDescriptor((4,)),))
    before = copy.deepcopy(module.state_dict())
    huge = torch.full((2, 4), 3e38)
    with pytest.raises(NonFiniteError, match="output 0 .* NaN or inf"):
        backend.forward(huge)
    with pytest.raises(NonFiniteError, match="no optimizer step"):
        backend.backward(torch.full((2, 4), 1e30), torch.full((2, 4), 1e30))
    assert all(torch.equal(module.state_dict()[k], v) for k, v in before.items())
    assert all(p.grad is None for p in module.parameters()), "no gradient left to leak into the next step"
    outputs = backend.backward(torch.randn(2, 4), torch.ones(2, 4))
    assert all(torch.isfinite(t).all() for t in outputs)
    assert not torch.equal(module.weight, before["weight"])
