"""hivemind's mixture-of-experts API: experts built from a DHT, descriptors, declarations, the
beam search's first step, uid rules and gating scores for any grid."""

import asyncio

import pytest
import torch
from hivemind import DHT
from hivemind.moe.client import RemoteMixtureOfExperts
from hivemind.moe.client.beam_search import MoEBeamSearcher
from hivemind.moe.client.expert import RemoteExpert, create_remote_experts
from hivemind.moe.expert_uid import ExpertInfo, is_valid_prefix, is_valid_uid
from hivemind.moe.server import background_server, declare_experts
from hivemind.moe.server.dht_handler import get_experts
from hivemind.p2p import P2PHandlerError
from hivemind.utils import get_dht_time
from hivemind.utils.tensor_descr import BatchTensorDescriptor, TensorDescriptor

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def served():
    uids = ["expert.0", "expert.1", "expert.0", "expert.1"]  # repeats fold into one expert each
    options = dict(device="cpu", expert_cls="ffn", hidden_dim=8, optim_cls=None)
    with background_server(expert_uids=uids, **options) as info:
        dht = DHT(initial_peers=info.addrs, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        yield info, dht
        dht.shutdown()


def test_experts_from_a_dht_the_hivemind_way(served):
    info, dht = served
    real, missing = create_remote_experts([ExpertInfo("expert.0", info.peer_id), None], dht=dht)
    assert missing is None and real(torch.randn(2, 8)).shape == (2, 8)
    p2p = asyncio.run(dht.replicate_p2p())
    by_hand = RemoteExpert(ExpertInfo("expert.1", info.peer_id), p2p)
    inputs = torch.randn(3, 8, requires_grad=True)
    # A random weighting: the ffn ends in a LayerNorm, whose outputs always sum to the same value.
    (by_hand(inputs) * torch.randn(3, 8)).sum().backward()
    assert inputs.grad is not None and inputs.grad.norm() > 0
    with pytest.raises(P2PHandlerError, match="11"):  # the server's own message reaches the caller
        by_hand(torch.randn(3, 11))
    future = get_experts(dht, ["expert.1", "expert.9"], return_future=True)
    found = asyncio.run(_await(future))
    assert [expert.uid if expert else None for expert in found] == ["expert.1", None]


async def _await(future):
    return await future


def test_descriptors_take_hiveminds_arguments():
    descriptor = BatchTensorDescriptor(8, 4, dtype=torch.float16)
    assert descriptor.shape == (8, 4) and descriptor.dtype == "float16"
    assert BatchTensorDescriptor((8, 4)) == BatchTensorDescriptor(8, 4)
    assert BatchTensorDescriptor.decode(descriptor.encode()) == descriptor
    described = TensorDescriptor.from_tensor(torch.zeros(2, 3, dtype=torch.float64, requires_grad=True))
    assert described.size == (2, 3) and described.dtype == torch.float64 and described.requires_grad
    with pytest.raises(TypeError):
        BatchTensorDescriptor(8, shape=(8,))


def test_declarations_return_every_record_and_the_initial_beam_is_scored():
    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        assert len(declare_experts(dht, ["ffn.1", "ffn.2"], get_dht_time() + 30)) == 4  # 2 uids, 2 prefixes
        stored = declare_experts(dht, ["e.1.2.3", "e.1.2.5", "e.2.0"], get_dht_time() + 30)
        assert len(stored) == 7 and all(stored.values())  # e.1. is shared by two uids
        assert all(declare_experts(dht, ["expert.1", "expert.2", "expert.3"], get_dht_time() + 30).values())
        with pytest.raises(TypeError):
            declare_experts(dht, "expert.4", get_dht_time() + 30)
        searcher = MoEBeamSearcher(dht, "expert.", grid_size=(10,))
        beam = searcher.get_initial_beam((3, 2, 1, 0, -1, -2, -3), beam_size=3)
        assert [entry[:2] for entry in beam] == [(2.0, "expert.1."), (1.0, "expert.2."), (0.0, "expert.3.")]
        assert beam[0][2][-1] == ExpertInfo("expert.1", dht.peer_id)
        short = searcher.find_best_experts([(0.0, 1.0, 2.0, 3.0)], beam_size=2)  # fewer scores than the grid
        assert [expert.uid for expert in short] == ["expert.3", "expert.2"]
        with pytest.raises(ValueError):
            MoEBeamSearcher(dht, "expert.1.ffn", (2, 2))
        with pytest.raises(ValueError):
            searcher.get_active_successors(["expert.", "expert.2"])
    finally:
        dht.shutdown()


def test_uids_with_trailing_newlines_are_invalid():
    assert is_valid_uid("expert.1") and is_valid_prefix("expert.1.")
    for bad in ("expert.1\n", "expert.1\n2", "expert.1 ", "expert.1\nexpert.2"):
        assert not is_valid_uid(bad) and not is_valid_prefix(bad + ".")
    assert not is_valid_prefix("expert.\n")


def test_expert_scores_follow_the_uids_grid():
    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        moe = RemoteMixtureOfExperts(dht=dht, in_features=16, grid_size=(40,), k_best=4, uid_prefix="expert.")
        gx, gy = torch.randn(2, 5, requires_grad=True), torch.randn(2, 3, requires_grad=True)

        def expert(uid):
            return RemoteExpert(ExpertInfo(uid, None), None)

        chosen = [[expert("expert.4.2"), expert("expert.0.1")], [expert("expert.3.0")]]
        logits = moe.compute_expert_scores([gx, gy], chosen)
        assert torch.allclose(logits[0], torch.stack([gx[0, 4] + gy[0, 2], gx[0, 0] + gy[0, 1]]))
        assert torch.allclose(logits[1, 0], gx[1, 3] + gy[1, 0])
        logits.sum().backward()
        assert gx.grad.norm() > 0 and gy.grad.norm() > 0
        with pytest.raises(ValueError, match="2 coordinates"):
            moe.compute_expert_scores([gx, gy], [[expert("expert.4")]])
    finally:
        dht.shutdown()
