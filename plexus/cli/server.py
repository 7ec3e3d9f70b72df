"""Serve mixture-of-experts experts and announce them in the DHT (hivemind-server's flags).

Prints the `--initial_peers` line other peers can join with, then serves until Ctrl+C or
SIGTERM, saving checkpoints (with --checkpoint_dir) on the way out.

Examples:
    plexus server --expert_cls ffn --hidden_dim 1024 --num_experts 16 --expert_pattern "ffn.[0:4].[0:16]" \\
        --host_maddrs /ip4/0.0.0.0/tcp/31337 --identity_path server.key
    plexus server --expert_uids ffn.0.0 ffn.0.1 --initial_peers /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...
    plexus server --config server.yml      # keys are the flag names below
"""

import os
import resource
import signal
import threading
import time

import torch

from ..compression import CompressionType
from ..errors import UsageError
from ..utils.logging import get_logger
from . import checks
from .config import add_peer_arguments

logger = get_logger(__name__)

OPTIMIZERS = {"adam": torch.optim.Adam, "sgd": lambda params: torch.optim.SGD(params, lr=0.01), "none": None}
FILE_LIMIT = 32768


def add_arguments(parser) -> None:
    experts = parser.add_argument_group("experts")
    experts.add_argument(
        "--num_experts", type=checks.positive_int, help="how many experts to serve (with --expert_pattern)"
    )
    experts.add_argument(
        "--expert_pattern",
        help="grid to sample uids from, e.g. 'ffn.[0:4].[0:16]' (uids other servers announce are skipped)",
    )
    experts.add_argument(
        "--expert_uids", nargs="+", metavar="UID", help="exact uids to serve, e.g. ffn.0.0 ffn.0.1"
    )
    experts.add_argument(
        "--expert_cls",
        default="ffn",
        help="registered expert class (ffn, transformer, nop, nop_delay, det_dropout, "
        "or one from --custom_module_path); default ffn",
    )
    experts.add_argument(
        "--hidden_dim", type=checks.positive_int, default=1024, help="experts' hidden size (default 1024)"
    )
    experts.add_argument(
        "--custom_module_path",
        type=checks.existing_file,
        help="Python file whose @register_expert_class experts to offer",
    )

    training = parser.add_argument_group("training")
    training.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default="adam",
        help="adam, sgd (lr 0.01) or none (experts do not learn); default adam",
    )
    training.add_argument(
        "--scheduler",
        choices=["none", "linear"],
        default="none",
        help="learning-rate schedule; linear needs the two step counts",
    )
    training.add_argument("--num_warmup_steps", type=checks.non_negative_int)
    training.add_argument("--num_training_steps", type=checks.positive_int)
    training.add_argument(
        "--clip_grad_norm", type=checks.positive_float, help="clip each expert's gradient to this global norm"
    )
    training.add_argument(
        "--checkpoint_dir",
        type=checks.directory_to_use,
        help="restore experts from here and save them every update_period",
    )

    runtime = parser.add_argument_group("runtime")
    runtime.add_argument("--min_batch_size", type=checks.positive_int, default=1)
    runtime.add_argument("--max_batch_size", type=checks.positive_int, default=16384)
    runtime.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    runtime.add_argument(
        "--compression",
        default="NONE",
        choices=[c.name for c in CompressionType],
        help="how activations and gradients travel (default NONE)",
    )
    runtime.add_argument("--num_handlers", type=int, help="accepted for hivemind compatibility; no effect")
    runtime.add_argument(
        "--stats_report_interval", type=float, help="accepted for compatibility; no effect yet"
    )
    runtime.add_argument(
        "--increase_file_limit",
        action="store_true",
        help=f"raise the open-file limit to {FILE_LIMIT} (many client connections)",
    )

    network = parser.add_argument_group("network")
    add_peer_arguments(network)
    network.add_argument(
        "--update_period",
        type=checks.positive_float,
        default=30.0,
        help="seconds between re-announcements in the DHT and checkpoints (default 30)",
    )
    network.add_argument(
        "--expiration",
        type=checks.positive_float,
        help="lifetime of an announcement (default max(2 * update_period, 3))",
    )
    parser.add_argument(
        "-c",
        "--config",
        metavar="FILE",
        help="read options from a JSON, TOML or YAML file whose keys are the flag names "
        "(command-line flags win)",
    )


def _raise_file_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = FILE_LIMIT if hard == resource.RLIM_INFINITY else min(FILE_LIMIT, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        logger.info(f"raised the open-file limit from {soft} to {target}")


def check_arguments(args) -> None:
    """Refuse what cannot work before joining the swarm, naming the flag to change."""
    from ..moe.expert_uid import is_valid_uid, parse_expert_pattern

    if args.expert_uids is None and args.num_experts is None and args.checkpoint_dir is None:
        raise UsageError(
            "say which experts to serve: --expert_uids ffn.0.0 ffn.0.1 ..., or --num_experts N with "
            "--expert_pattern 'ffn.[0:4].[0:16]'"
        )
    bad = [uid for uid in args.expert_uids or () if not is_valid_uid(uid)]
    if bad:
        raise UsageError(
            f"--expert_uids: {bad[0]!r} is not an expert uid (a name and integer coordinates: ffn.0.3)"
        )
    if args.expert_uids and args.num_experts is not None and args.num_experts != len(set(args.expert_uids)):
        raise UsageError(
            f"--num_experts {args.num_experts} disagrees with the {len(set(args.expert_uids))} --expert_uids"
        )
    if args.expert_pattern is not None:
        try:
            parse_expert_pattern(args.expert_pattern)
        except ValueError as error:
            raise UsageError(f"--expert_pattern: {error}") from None
    if args.min_batch_size > args.max_batch_size:
        raise UsageError(
            f"--min_batch_size {args.min_batch_size} is above --max_batch_size {args.max_batch_size}"
        )
    if args.scheduler == "linear" and (args.num_warmup_steps is None or args.num_training_steps is None):
        raise UsageError("--scheduler linear needs --num_warmup_steps and --num_training_steps")
    if args.device is not None:
        try:
            torch.device(args.device)
        except RuntimeError:
            raise UsageError(f"--device {args.device!r} is not a device: use cpu, cuda or cuda:N") from None


def run(args) -> int:
    from ..moe.server.server import Server  # torch-heavy: imported when the command runs

    check_arguments(args)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    if args.increase_file_limit:
        _raise_file_limit()
    if args.num_handlers is not None or args.stats_report_interval is not None:
        logger.debug("--num_handlers and --stats_report_interval have no effect in Plexus")
    if args.identity_path and not os.path.exists(args.identity_path):
        logger.info(f"Generating new identity (libp2p private key) in {args.identity_path}")
    started = time.perf_counter()
    server = Server.create(
        num_experts=args.num_experts,
        expert_uids=args.expert_uids,
        expert_pattern=args.expert_pattern,
        expert_cls=args.expert_cls,
        hidden_dim=args.hidden_dim,
        optim_cls=OPTIMIZERS[args.optimizer],
        scheduler=args.scheduler,
        num_warmup_steps=args.num_warmup_steps,
        num_training_steps=args.num_training_steps,
        clip_grad_norm=args.clip_grad_norm,
        min_batch_size=args.min_batch_size,
        max_batch_size=args.max_batch_size,
        device=args.device,
        initial_peers=args.initial_peers,
        checkpoint_dir=args.checkpoint_dir,
        compression=CompressionType[args.compression],
        custom_module_path=args.custom_module_path,
        update_period=args.update_period,
        expiration=args.expiration,
        start=True,
        host_maddrs=args.host_maddrs,
        announce_maddrs=args.announce_maddrs,
        identity_path=args.identity_path,
        use_relay=not args.no_relay,
        use_auto_relay=args.use_auto_relay,
    )
    try:
        visible = [str(addr) for addr in server.dht.get_visible_maddrs()]
        logger.info(f"Running DHT node on [{', '.join(visible)}], initial peers = {args.initial_peers}")
        maddrs = " ".join(visible)
        uids = list(server.module_backends)
        logger.info(
            f"serving {len(uids)} experts ({', '.join(uids[:4])}{', ...' if len(uids) > 4 else ''}); "
            f"started in "
            f"{time.perf_counter() - started:.1f} s"
        )
        logger.info(f"To connect other peers to this one, use --initial_peers {maddrs}")
        stop.wait()
        logger.info("shutting down")
    finally:
        server.shutdown()
        logger.info("expert server stopped")
    return 0
