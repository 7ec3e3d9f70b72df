"""Two honest plexus.Optimizer peers and a hostile peer that publishes forged but correctly signed
progress records through the public DHT API.

The forgeries are the ones that used to stall or shrink the swarm: an epoch of 10**9 (peers looped
in loading state), a speed of 1e300 (epochs at a fraction of the target batch), 10**12 samples
(premature epochs) and a time far ahead (a ghost peer every round waited for)."""

import queue
import threading

import pytest

from plexus.dht.crypto import Ed25519SignatureValidator
from plexus.dht.dht import DHT
from plexus.p2p.identity import PrivateKey
from plexus.utils.timing import get_dht_time
from tests.test_optimizer_peer import LOCAL, start_threads

pytestmark = pytest.mark.timeout(120)
TARGET, EPOCHS = 64, 4


def forge(dht: DHT, key: str, stop: threading.Event) -> None:
    """Keep the forged records fresh until `stop`, each under an identity of its own."""
    forgeries = [
        dict(epoch=10**9),
        dict(samples_per_second=1e300),
        dict(samples_accumulated=10**12),
        dict(time_ahead=1e6),
    ]
    signers = [(PrivateKey.generate(), forgery) for forgery in forgeries]
    dht.add_validators([Ed25519SignatureValidator(private_key) for private_key, _ in signers])
    while not stop.is_set():
        now = get_dht_time()
        for private_key, forgery in signers:
            record = dict(
                peer_id=private_key.peer_id.to_bytes(),
                epoch=0,
                samples_accumulated=TARGET - 1,
                samples_per_second=100.0,
                time=now + forgery.get("time_ahead", 0.0),
                client_mode=False,
            )
            record.update({name: value for name, value in forgery.items() if name != "time_ahead"})
            subkey = Ed25519SignatureValidator(private_key).local_public_key
            dht.store(key, record, now + 30, subkey=subkey)
        stop.wait(0.3)


def test_honest_peers_keep_training_with_full_batches_beside_a_forger():
    config = dict(target_batch_size=TARGET, epochs=EPOCHS, step_delay=0.01, averaging_timeout=10.0)
    results, events, stop = {}, queue.Queue(), threading.Event()
    threads, maddrs = start_threads([config, config], results, events)
    hostile = DHT(initial_peers=maddrs, start=True, host_maddrs=LOCAL)
    forger = threading.Thread(target=forge, args=(hostile, "run_progress", stop), daemon=True)
    forger.start()
    try:
        for thread in threads:
            thread.join(100)
        assert not any(thread.is_alive() for thread in threads), "an honest peer stopped training"
    finally:
        stop.set()
        forger.join(10)
        hostile.shutdown()
    for outcome in results.values():
        assert outcome["epoch"] == EPOCHS, "the forged epoch was never adopted, nor any epoch skipped"
        assert outcome["state_loads"] == 0, "nobody went looking for a state of epoch 10**9"
    for epoch in range(EPOCHS):
        honest_samples = sum(len(results[peer]["contributions"].get(epoch, ())) for peer in results)
        assert honest_samples >= TARGET, f"epoch {epoch} stepped after {honest_samples} honest samples"
