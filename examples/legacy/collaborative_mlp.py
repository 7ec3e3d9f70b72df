#!/usr/bin/env python
"""A collaborative training script in the style of the DeDLOC/sahajBERT era (hivemind's
CollaborativeOptimizer), left as it was: it imports `hivemind`. Run it on Plexus with

    python -m plexus.compat examples/legacy/collaborative_mlp.py --wait_for_peers 1   # the first peer
    python -m plexus.compat examples/legacy/collaborative_mlp.py --wait_for_peers 1 \
        --initial_peers <the address the first peer logged>

Peers that share --prefix train one small MLP on synthetic data: each computes gradients on its
own batches, and they take a global step together whenever the swarm has processed
--target_batch_size samples. Each stops after --max_steps global steps.
"""

import argparse
import logging
import time

import hivemind
import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

parser = argparse.ArgumentParser()
parser.add_argument("--initial_peers", nargs="*", default=[], help="multiaddrs of peers already training")
parser.add_argument("--prefix", default="legacy_mlp", help="peers with the same prefix train together")
parser.add_argument("--target_batch_size", type=int, default=64, help="samples per global step, swarm-wide")
parser.add_argument("--batch_size", type=int, default=16, help="samples per local step")
parser.add_argument("--max_steps", type=int, default=3, help="global steps to take before leaving")
parser.add_argument("--wait_for_peers", type=int, default=0, help="wait for this many others before training")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
logging.basicConfig(format="%(asctime)s [%(levelname)s] %(message)s", level=logging.INFO)
torch.manual_seed(args.seed)

dht = hivemind.DHT(initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
logger.info(f"To join the collaboration, use --initial_peers {' '.join(map(str, dht.get_visible_maddrs()))}")

model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
collaborative_optimizer = hivemind.CollaborativeOptimizer(
    opt=opt,
    dht=dht,
    prefix=args.prefix,
    target_batch_size=args.target_batch_size,
    batch_size_per_step=args.batch_size,
    compression_type=hivemind.utils.CompressionType.Value("FLOAT16"),
    averaging_expiration=1.0,
    averaging_timeout=10.0,
    metadata_expiration=10.0,
    min_refresh_period=0.2,
    max_refresh_period=1.0,
    default_refresh_period=0.5,
    target_group_size=2,
    verbose=True,
    start=True,
)

while collaborative_optimizer.fetch_collaboration_state().num_peers < args.wait_for_peers:
    time.sleep(0.5)  # the others are still starting (until it trains, a peer counts only the others)
if not collaborative_optimizer.is_synchronized:
    collaborative_optimizer.load_state_from_peers()

while collaborative_optimizer.local_step < args.max_steps:
    inputs = torch.randn(args.batch_size, 16)
    labels = (inputs.sum(dim=-1) > 0).long()  # a task the model can learn
    loss = F.cross_entropy(model(inputs), labels)
    loss.backward()
    collaborative_optimizer.step()
    collaborative_optimizer.zero_grad()

state = collaborative_optimizer.collaboration_state
logger.info(
    f"Finished at global step {collaborative_optimizer.local_step} of {state.optimizer_step}, "
    f"loss {loss.item():.3f}"
)
collaborative_optimizer.shutdown()
dht.shutdown()
