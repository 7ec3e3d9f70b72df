#!/usr/bin/env python3
"""The swarm's first peer: welcomes trainers, and records the training's progress.

    python run_training_monitor.py                                   # prints the --initial_peers line
    python run_training_monitor.py --wandb_project Demo-run          # also log to Weights & Biases
    python run_training_monitor.py --host_maddrs /ip4/0.0.0.0/tcp/31337 --identity_path ./identity.key \\
        --announce_maddrs /ip4/PUBLIC_IP/tcp/31337                   # the same address after every restart
    python run_training_monitor.py --store_checkpoints --save_checkpoint_step_interval 10
    python run_training_monitor.py --dashboard 8080      # a live dashboard at http://127.0.0.1:8080/

It needs no GPU and little bandwidth, only uptime. Every --refresh_period seconds it reads the
trainers' signed metrics (metrics.py) and, for each global step, logs `Step #N  loss = x` with the
number of peers that took part, their samples and the swarm's samples/s. Each step is appended to
--metrics_path (CSV) and, with --wandb_project, to W&B (install wandb; WANDB_MODE=offline works
without an account). With --store_checkpoints it downloads the averaged model and optimizer state
every few steps into --checkpoint_dir, and pushes the model to the Hugging Face Hub only with
--push_to_hub.

By default the monitor gets a new address at every start. To hand out a fixed one, listen on a
fixed port (--host_maddrs) and keep the peer id in a file (--identity_path); behind a router that
forwards that port, also --announce_maddrs with the public IP.
"""

import argparse
import csv
import dataclasses
import json
import logging
import os
import shutil
import time

import plexus
from plexus.cli import checks
from plexus.cli.errors import ArgumentParser
from plexus.dashboard.address import add_dashboard_argument
from plexus.errors import UsageError
from plexus.utils.logging import use_plexus_log_handler

from .metrics import StepTable, make_validators, metrics_key, parse_records
from .swarm import stop_on_signals

logger = logging.getLogger("plexus.albert")
PROGRESS_STALE_AFTER = 30.0  # seconds: a trainer's progress record older than this counts as gone


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    swarm = parser.add_argument_group("swarm")
    swarm.add_argument(
        "--run_id", default="albert", help="the collaboration's name, as the trainers' (default: albert)"
    )
    swarm.add_argument(
        "--initial_peers",
        nargs="*",
        type=checks.multiaddr,
        default=[],
        help="other monitors or trainers to join, if any",
    )
    swarm.add_argument(
        "--use_ipfs",
        action="store_true",
        help="be findable (and find --initial_peers given as /p2p/<peer id>) through the IPFS DHT",
    )
    swarm.add_argument(
        "--host_maddrs",
        nargs="+",
        type=checks.multiaddr,
        default=["/ip4/0.0.0.0/tcp/0"],
        help="addresses to listen on (default: any interface, a random port)",
    )
    swarm.add_argument(
        "--announce_maddrs",
        nargs="*",
        type=checks.multiaddr,
        default=[],
        help="addresses to tell peers instead, e.g. /ip4/PUBLIC_IP/tcp/31337",
    )
    swarm.add_argument(
        "--identity_path",
        default=None,
        help="file with this peer's private key (created if missing): the same peer id every start",
    )
    record = parser.add_argument_group("recording")
    record.add_argument(
        "--refresh_period",
        type=checks.positive_float,
        default=30.0,
        help="seconds between reads (default: 30)",
    )
    record.add_argument(
        "--settle_time",
        type=float,
        default=None,
        help="seconds to wait for late reports before a step is final (default: --refresh_period)",
    )
    record.add_argument(
        "--metrics_path", default="logs/training_metrics.csv", help="CSV with one row per step"
    )
    record.add_argument(
        "--status_path",
        default=None,
        help="also keep a JSON snapshot of the swarm here, rewritten every refresh (the demo's view)",
    )
    record.add_argument(
        "--wandb_project", default=None, help="log every step to this Weights & Biases project"
    )
    add_dashboard_argument(record)
    ckpt = parser.add_argument_group("checkpoints")
    ckpt.add_argument("--store_checkpoints", action="store_true", help="download and save the averaged state")
    ckpt.add_argument(
        "--save_checkpoint_step_interval", type=int, default=5, help="every this many steps (default: 5)"
    )
    ckpt.add_argument("--checkpoint_dir", default="checkpoints", help="where checkpoint-N folders go")
    ckpt.add_argument(
        "--keep_checkpoints", type=int, default=2, help="older checkpoints are deleted (default: 2)"
    )
    ckpt.add_argument(
        "--push_to_hub", action="store_true", help="also push each checkpoint's model to the Hub"
    )
    ckpt.add_argument(
        "--hub_repo_id", default=None, help="the Hub repository for --push_to_hub, e.g. me/albert-swarm"
    )
    ckpt.add_argument(
        "--config", default="tiny", help="the trainers' --config (tiny, large or a config path)"
    )
    ckpt.add_argument("--dataset_path", default="data/albert_tokenized", help="the trainers' --dataset_path")
    ckpt.add_argument("--optimizer", default="lamb", help="the trainers' --optimizer (lamb or adamw)")
    args = parser.parse_args(argv)
    if args.push_to_hub and not args.hub_repo_id:
        parser.error("--push_to_hub needs --hub_repo_id")
    if args.settle_time is None:
        args.settle_time = args.refresh_period
    return args


class Checkpointer:
    """Downloads the swarm's state (as a newcomer would) and saves it as a transformers checkpoint."""

    def __init__(self, dht, args):
        import torch  # noqa: F401  (heavy imports only when checkpoints are wanted)

        from .data import read_meta
        from .model import AlbertForMaskedOnlyPreTraining, parameter_groups
        from .run_trainer import load_config, optimizer_factory

        meta = read_meta(args.dataset_path)
        self.model = AlbertForMaskedOnlyPreTraining(
            load_config(args.config, meta["vocab_size"], meta["seq_length"])
        )
        self.args, self.tokenizer_path = args, os.path.join(args.dataset_path, "tokenizer")
        # the same kind of optimizer and groups as the trainers: their state only loads into that
        self.averager = plexus.TrainingStateAverager(
            dht=dht,
            prefix=f"{args.run_id}_state_averager",
            params=parameter_groups(self.model, 0.0),
            optimizer=optimizer_factory(args.optimizer, lr=1e-3),
            allow_state_sharing=False,
            start=True,
        )

    def save(self, step: int) -> None:
        import torch

        if not self.averager.load_state_from_peers(timeout=60):
            logger.warning(f"No peer shared its state; no checkpoint at step {step}")
            return
        folder = os.path.join(self.args.checkpoint_dir, f"checkpoint-{self.averager.local_epoch}")
        self.model.save_pretrained(folder)
        torch.save(
            dict(self.averager.optimizer.state_dict(), local_epoch=self.averager.local_epoch),
            os.path.join(folder, "optimizer.pt"),
        )
        if os.path.isdir(self.tokenizer_path):
            shutil.copytree(self.tokenizer_path, folder, dirs_exist_ok=True)
        logger.info(f"Saved the swarm's state of epoch {self.averager.local_epoch} to {folder}")
        self._delete_old()
        if self.args.push_to_hub:
            self.model.push_to_hub(self.args.hub_repo_id, commit_message=f"Step #{self.averager.local_epoch}")

    def _delete_old(self) -> None:
        folders = [name for name in os.listdir(self.args.checkpoint_dir) if name.startswith("checkpoint-")]
        for name in sorted(folders, key=lambda name: int(name.split("-")[1]))[: -self.args.keep_checkpoints]:
            shutil.rmtree(os.path.join(self.args.checkpoint_dir, name), ignore_errors=True)

    def shutdown(self) -> None:
        self.averager.shutdown()


class MetricsFile:
    """One CSV row per step; appends across restarts (the header is written once)."""

    FIELDS = ("step", "loss", "alive_peers", "samples", "samples_per_second", "time")

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fresh = not os.path.exists(path) or os.path.getsize(path) == 0
        self.file = open(path, "a", newline="")
        self.writer = csv.DictWriter(self.file, self.FIELDS)
        if fresh:
            self.writer.writeheader()

    def write(self, row) -> None:
        self.writer.writerow(dataclasses.asdict(row))
        self.file.flush()


def swarm_progress(found, now: float) -> dict:
    """The optimizer's progress records (see plexus.optim.progress_tracker): the epoch, samples and
    speed the swarm reports right now, between the steps the metrics describe."""
    peers = []
    if found is not None and isinstance(found.value, dict):
        for entry in found.value.values():
            report = entry.value
            if _is_fresh_progress(report, now):
                peers.append(report)
    workers = [p for p in peers if not p.get("client_mode")] or peers
    epoch = max((p["epoch"] for p in workers), default=0)
    return dict(
        epoch=epoch,
        peers=len(peers),
        clients=sum(bool(p.get("client_mode")) for p in peers),
        samples_accumulated=sum(p["samples_accumulated"] for p in peers if p["epoch"] == epoch),
        samples_per_second=sum(p["samples_per_second"] for p in peers),
    )


def _is_fresh_progress(report, now: float) -> bool:
    """Only well-formed, recent reports count (the DHT's schema only guards the peers that declared it)."""
    types = dict(epoch=int, samples_accumulated=int, samples_per_second=float, time=float, client_mode=bool)
    return (
        isinstance(report, dict)
        and all(isinstance(report.get(key), kind) for key, kind in types.items())
        and now - report["time"] <= PROGRESS_STALE_AFTER
    )


def write_status(path: str, status: dict) -> None:
    """Replace the file atomically: a reader never sees half of it."""
    with open(path + ".tmp", "w") as f:
        json.dump(status, f)
    os.replace(path + ".tmp", path)


def main(argv=None):
    args = parse_args(argv)
    if args.dashboard is not None:
        from plexus.dashboard.server import Dashboard, require_aiohttp

        try:
            require_aiohttp()  # a missing extra is a one-line error before anything starts
        except UsageError as error:
            raise UsageError(f"--dashboard: {error}") from None
    use_plexus_log_handler()
    stop_on_signals()
    dht = plexus.DHT(
        initial_peers=args.initial_peers,
        start=True,
        host_maddrs=args.host_maddrs,
        announce_maddrs=args.announce_maddrs,
        identity_path=args.identity_path,
        use_ipfs=args.use_ipfs,
    )
    validators, _ = make_validators(args.run_id, dht.private_key)
    dht.add_validators(validators)
    addresses = [str(addr) for addr in dht.get_visible_maddrs()]
    logger.info(
        f"Running a DHT instance. To connect other peers to this one, use --initial_peers {' '.join(addresses)}"
    )
    logger.info(
        f"Full list of visible multiaddresses: {' '.join(str(a) for a in dht.get_visible_maddrs(latest=True))}"
    )

    wandb = None
    if args.wandb_project:
        try:
            import wandb
        except ImportError:
            raise UsageError(
                "--wandb_project needs wandb: pip install wandb (WANDB_MODE=offline works without an account)"
            ) from None
        wandb.init(project=args.wandb_project, config=dict(run_id=args.run_id))
    dashboard = None
    if args.dashboard is not None:
        host, port = args.dashboard
        try:
            dashboard = Dashboard(dht, args.run_id, host=host, port=port)
        except UsageError as error:  # e.g. the port is taken
            dht.shutdown()
            raise UsageError(f"--dashboard: {error}") from None
        logger.info(f"Dashboard: {dashboard.url}")
    metrics_file = MetricsFile(args.metrics_path)
    checkpointer = Checkpointer(dht, args) if args.store_checkpoints else None
    table, last_row, quiet_since = StepTable(args.settle_time), None, time.monotonic()

    def record(rows, checkpoints: bool = True) -> None:
        nonlocal last_row
        for row in rows:
            logger.info(
                f"Step #{row.step}  loss = {row.loss:.5f}  alive peers: {row.alive_peers}  "
                f"samples: {row.samples}  samples/s: {row.samples_per_second:.1f}"
            )
            metrics_file.write(row)
            if dashboard is not None:
                dashboard.record_step(row.step, row.loss, row.samples_per_second, row.time)
            if wandb is not None:
                wandb.log(
                    dict(
                        loss=row.loss,
                        alive_peers=row.alive_peers,
                        samples=row.samples,
                        performance=row.samples_per_second,
                        step=row.step,
                    )
                )
            last_row = row
            if (
                checkpoints
                and checkpointer is not None
                and row.step % args.save_checkpoint_step_interval == 0
            ):
                checkpointer.save(row.step)

    try:
        while True:
            started = time.monotonic()
            now = plexus.get_dht_time()
            records = parse_records(dht.get(metrics_key(args.run_id), latest=True))
            progress = swarm_progress(dht.get(f"{args.run_id}_progress", latest=True), now)
            record(table.update(records, now))
            if progress["peers"] or records:
                quiet_since = started
            elif started - quiet_since >= max(args.refresh_period, 5.0):
                logger.info("Found no active peers")
                quiet_since = started
            if args.status_path:
                write_status(
                    args.status_path,
                    dict(
                        time=now,
                        initial_peers=addresses,
                        progress=progress,
                        last_step=dataclasses.asdict(last_row) if last_row else None,
                        peers_seen=len(table.peers_seen),
                        trainers=[
                            dict(
                                peer_id=peer_id,
                                client_mode=m.client_mode,
                                step=m.history[-1].step,
                                loss=m.history[-1].loss,
                                samples_per_second=m.history[-1].samples_per_second,
                            )
                            for peer_id, m in sorted(records.items())
                            if m.history
                        ],
                    ),
                )
            time.sleep(max(0.0, args.refresh_period - (time.monotonic() - started)))
    except KeyboardInterrupt:
        logger.info("Stopping the monitor")
    finally:
        record(table.flush(), checkpoints=False)  # the trainers may be gone: no download now
        if checkpointer is not None:
            checkpointer.shutdown()
        if wandb is not None:
            wandb.finish()
        if dashboard is not None:
            dashboard.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    from plexus.cli.errors import exit_with

    exit_with(main)
