"""use_local_updates=True: each peer steps on its own batches, and the state round at every epoch's
end pulls the peers together. Two peers on different data (each fits its own target), in threads."""

import queue
import threading
import time

import pytest
import torch

from plexus.dht.dht import DHT
from plexus.optim.optimizer import Optimizer
from plexus.testing import RegressionTask, flat_parameters

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
# epochs here last a second or two: the newcomer believes the first peer's epoch (and so downloads
# the state) once that claim stood for epoch_claim_grace, which must be shorter than an epoch
FAST_TRACKER = dict(
    min_refresh_period=0.05, max_refresh_period=1.0, default_refresh_period=0.2, epoch_claim_grace=0.2
)
EPOCHS = 8


def train(
    index: int, task: RegressionTask, addresses: queue.Queue, joined: threading.Event, record: dict
) -> None:
    """Train to EPOCHS; record, per epoch, the parameters right after a step began it and the state
    the averager holds at the epoch's end (the result of that epoch's round, once it is over)."""
    dht = DHT(initial_peers=None if index == 0 else addresses.get(timeout=30), start=True, host_maddrs=LOCAL)
    if index == 0:
        addresses.put(dht.get_visible_maddrs())
    model = task.make_model()
    opt = Optimizer(
        dht=dht,
        run_id="local_updates",
        target_batch_size=1024,
        batch_size_per_step=task.batch_size,
        optimizer=task.make_optimizer(),
        params=model.parameters(),
        matchmaking_time=1.0,
        averaging_timeout=20.0,
        tracker_opts=FAST_TRACKER,
        use_local_updates=True,
    )
    try:
        batches = task.batches(index)
        while opt.local_epoch < EPOCHS:
            epoch, loads = opt.local_epoch, opt.state_loads
            task.loss(model, next(batches)).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(task.step_delay)  # stands for compute time
            if opt.local_epoch != epoch and opt.state_loads == loads:  # a global step, not a download
                record.setdefault("boundary", {})[opt.local_epoch] = flat_parameters(model)
            with opt.state_averager.get_tensors() as averaged:
                record.setdefault("round", {})[opt.local_epoch] = torch.cat([t.reshape(-1) for t in averaged])
            if opt.local_epoch >= 1:
                joined.set()
    finally:
        opt.shutdown()
        dht.shutdown()


@pytest.mark.timeout(120)
def test_peers_on_different_data_average_to_their_mean_at_every_epoch():
    task = RegressionTask(peer_targets=True, lr=0.01, step_delay=0.02)
    addresses, joined, records = queue.Queue(), threading.Event(), [{}, {}]
    first = threading.Thread(target=train, args=(0, task, addresses, joined, records[0]), daemon=True)
    first.start()
    assert joined.wait(60), "the first peer did not reach epoch 1"
    # the second peer joins late: it downloads the state, so its epochs begin out of step with the first's
    second = threading.Thread(
        target=train, args=(1, task, addresses, threading.Event(), records[1]), daemon=True
    )
    second.start()
    for thread in (first, second):
        thread.join(100)
        assert not thread.is_alive(), "a peer did not finish"

    epochs = sorted(set(records[0]["boundary"]) & set(records[1]["boundary"]))[:-1]
    assert len(epochs) >= EPOCHS - 4
    alike = [e for e in epochs if torch.equal(records[0]["round"][e], records[1]["round"][e])]
    assert len(alike) >= len(epochs) - 1, (
        f"the peers' rounds averaged together only at epochs {alike} of {epochs}"
    )
    for epoch in alike:
        a, b = records[0]["boundary"][epoch], records[1]["boundary"][epoch]
        apart = float((a - b).norm())
        assert apart > 0.05, "the peers fit different targets: they drift apart within an epoch"
        middle = float((records[0]["round"][epoch] - (a + b) / 2).norm())
        assert middle < 0.25 * apart, f"epoch {epoch}: the round did not bring them to their mean"
