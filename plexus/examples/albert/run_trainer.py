#!/usr/bin/env python3
"""Pre-train ALBERT together: a peer of the swarm, built on Hugging Face's Trainer and plexus.Optimizer.

    python run_trainer.py --initial_peers /ip4/1.2.3.4/tcp/31337/p2p/XXXX       # tiny model, CPU is fine
    python run_trainer.py --initial_peers ONE_OR_MORE_PEERS --client_mode       # behind NAT or a firewall
    python run_trainer.py --initial_peers ONE_OR_MORE_PEERS --config large --learning_rate 0.00176 \\
        --warmup_steps 5000 --total_steps 125000 --target_batch_size 4096 --per_device_train_batch_size 4 \\
        --gradient_accumulation_steps 2 --dataset_path data/albert_tokenized_wikitext      # albert-large-v2
    python run_trainer.py --local --max_steps 200                               # alone, no swarm: a baseline

Flags: every `transformers.TrainingArguments` flag, plus the swarm's (CollaborationArguments) and the
data's (DatasetArguments) below. Data comes from tokenize_corpus.py; each peer reads it in its own
order, seeded by its peer id.

How it trains: Trainer runs forward and backward on micro-batches and calls `optimizer.step()`
every `gradient_accumulation_steps` of them. That optimizer is plexus.Optimizer wrapping LAMB (or
AdamW) with a linear warm-up and decay: it only accumulates, until the whole swarm has
`target_batch_size` samples; then the peers average their gradients and all take the same step (a
*global epoch*). The learning-rate schedule counts global epochs. A peer that joins late, or falls
behind, downloads the current state from the others first.

It resumes from the newest checkpoint in --output_dir unless --overwrite_output_dir is given (and
then still takes the swarm's state if the swarm is ahead). fp16 is used only where a GPU is.
"""

import hashlib
import logging
import os
from dataclasses import dataclass, field
from functools import partial

import torch
import transformers
from transformers import HfArgumentParser, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from plexus.errors import UsageError

from .collaboration import LossMeter, NoOpScheduler, SwarmCallback
from .data import MaskingCollator, PeerShuffledStream, PretrainingDataset
from .lamb import Lamb
from .metrics import make_validators
from .model import AlbertForMaskedOnlyPreTraining, count_parameters, make_config, parameter_groups
from .swarm import stop_on_signals

logger = logging.getLogger("plexus.albert")


@dataclass
class CollaborationArguments:
    """How this peer joins the swarm (ignored with --local)."""

    local: bool = field(
        default=False, metadata={"help": "train alone with the same optimizer, no swarm (a baseline)"}
    )
    run_id: str = field(
        default="albert",
        metadata={"help": "name of the collaboration; peers with the same run_id train together"},
    )
    initial_peers: list[str] = field(
        default_factory=list,
        metadata={"help": "multiaddresses of peers already in the swarm (monitor or trainers)"},
    )
    use_ipfs: bool = field(
        default=False,
        metadata={
            "help": "find initial peers given as /p2p/<peer id> alone through the IPFS DHT "
            "(all peers should use it)"
        },
    )
    host_maddrs: list[str] = field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"], metadata={"help": "addresses to listen on"}
    )
    announce_maddrs: list[str] = field(
        default_factory=list,
        metadata={"help": "addresses to tell other peers (e.g. a public IP), if not the listening ones"},
    )
    identity_path: str | None = field(
        default=None,
        metadata={
            "help": "file with this peer's private key (created if missing), to keep its "
            "peer id across restarts"
        },
    )
    client_mode: bool = field(
        default=False, metadata={"help": "for peers behind NAT or firewalls: dial out, accept no connections"}
    )
    target_batch_size: int = field(
        default=4096, metadata={"help": "samples the whole swarm accumulates per optimizer step"}
    )
    batch_size_lead: int = field(
        default=0, metadata={"help": "start averaging this many samples before the target is reached"}
    )
    matchmaking_time: float = field(
        default=5.0, metadata={"help": "seconds to gather a group before averaging"}
    )
    averaging_timeout: float = field(
        default=60.0, metadata={"help": "give up on an averaging round after this many seconds"}
    )
    bandwidth: float = field(
        default=100.0, metadata={"help": "this peer's bandwidth in Mbit/s, to share the work of averaging"}
    )
    target_group_size: int = field(default=256, metadata={"help": "largest group that averages together"})
    statistics_expiration: float = field(
        default=600.0, metadata={"help": "seconds this peer's published metrics stay valid"}
    )


@dataclass
class DatasetArguments:
    dataset_path: str = field(
        default="data/albert_tokenized", metadata={"help": "output of tokenize_corpus.py"}
    )
    tokenizer_path: str = field(
        default="",
        metadata={
            "aliases": ["--tokenizer"],
            "help": "tokenizer saved with the checkpoints (default: DATASET_PATH/tokenizer)",
        },
    )
    config: str = field(
        default="tiny",
        metadata={
            "help": "model shape: tiny (0.76 M parameters, the demo's), large "
            "(albert-large-v2's), or a folder or config.json with an AlbertConfig"
        },
    )


@dataclass
class AlbertTrainingArguments(TrainingArguments):
    """TrainingArguments with this example's defaults (for the tiny model), plus the tutorial's flags."""

    optimizer: str = field(default="lamb", metadata={"help": "lamb (as ALBERT) or adamw"})
    clamp_value: float = field(
        default=10000.0, metadata={"help": "LAMB's cap on a tensor's norm in its trust ratio"}
    )
    per_device_train_batch_size: int = 32
    gradient_accumulation_steps: int = 1
    learning_rate: float = 0.05  # LAMB on the tiny model; ALBERT-large used 0.00176; AdamW on tiny: 0.002
    warmup_steps: int = 20  # global epochs of linear warm-up
    total_steps: int = field(
        default=1000, metadata={"help": "global epochs at which the learning rate has decayed linearly to 0"}
    )
    adam_epsilon: float = 1e-6
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    max_steps: int = 10**9  # collaborative training runs until stopped
    fp16: bool = torch.cuda.is_available()  # on CPU, fp16 autocast is ~8x slower: never there
    logging_steps: int = 10
    logging_first_step: bool = True
    save_steps: int = 500
    save_total_limit: int | None = 2
    output_dir: str = "outputs"
    logging_dir: str = field(default="logs", metadata={"help": "metrics.jsonl goes here"})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "start from a fresh model instead of the newest checkpoint in OUTPUT_DIR"},
    )
    ignore_data_skip: bool = True  # the stream is endless and shuffled per peer: nothing to skip on resume
    remove_unused_columns: bool = (
        False  # the collator needs special_tokens_mask, which forward() does not take
    )
    label_names: list[str] | None = field(default_factory=lambda: ["labels", "sentence_order_label"])
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = torch.cuda.is_available()


def optimizer_factory(
    name: str,
    lr: float,
    betas=(0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float = 0.01,
    clamp_value: float = 10000.0,
):
    """params -> the local optimizer (the monitor builds the same kind to read the swarm's state)."""
    if name == "lamb":
        return partial(
            Lamb, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, clamp_value=clamp_value, debias=True
        )
    if name == "adamw":
        return partial(torch.optim.AdamW, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    raise UsageError(f"unknown --optimizer {name!r}; use lamb or adamw")


def local_optimizer_factory(args: AlbertTrainingArguments):
    return optimizer_factory(
        args.optimizer,
        args.learning_rate,
        (args.adam_beta1, args.adam_beta2),
        args.adam_epsilon,
        args.weight_decay,
        args.clamp_value,
    )


def scheduler_factory(args: AlbertTrainingArguments):
    return partial(
        transformers.get_linear_schedule_with_warmup,
        num_warmup_steps=args.warmup_steps,
        num_training_steps=args.total_steps,
    )


def make_swarm_optimizer(model, args: AlbertTrainingArguments, collab: CollaborationArguments, dht):
    import plexus

    return plexus.Optimizer(
        dht=dht,
        run_id=collab.run_id,
        target_batch_size=collab.target_batch_size - collab.batch_size_lead,
        batch_size_per_step=batch_size_per_step(args),
        optimizer=local_optimizer_factory(args),
        params=parameter_groups(model, args.weight_decay),
        scheduler=scheduler_factory(args),
        matchmaking_time=collab.matchmaking_time,
        averaging_timeout=collab.averaging_timeout,
        client_mode=collab.client_mode,
        averager_opts=dict(bandwidth=collab.bandwidth, target_group_size=collab.target_group_size),
        grad_compression=plexus.Float16Compression(),
        state_averaging_compression=plexus.Float16Compression(),
        verbose=True,
    )


def batch_size_per_step(args: AlbertTrainingArguments) -> int:
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * max(1, args.n_gpu)


def load_config(name: str, vocab_size: int, seq_length: int) -> transformers.AlbertConfig:
    if name in ("tiny", "large"):
        return make_config(name, vocab_size, seq_length)
    if not os.path.exists(name):
        raise UsageError(f"--config {name!r} is neither tiny, large, nor a folder or config.json")
    config = transformers.AlbertConfig.from_pretrained(name, local_files_only=True)
    if config.vocab_size != vocab_size:
        raise UsageError(
            f"--config {name!r} has a vocabulary of {config.vocab_size} tokens but the "
            f"dataset's tokenizer has {vocab_size}; use that tokenizer's data or fix vocab_size"
        )
    return config


def peer_seed(peer_id_bytes: bytes) -> int:
    return int.from_bytes(hashlib.sha256(peer_id_bytes).digest()[:4], "big")


class PretrainingTrainer(Trainer):
    """Trainer that logs the MLM and SOP losses separately (plot MLM: SOP stays near 0.69 for long)
    and feeds the MLM loss to the swarm's metrics."""

    def __init__(self, *args, losses: LossMeter, **kwargs):
        super().__init__(*args, **kwargs)
        self._sums, self._count, self.losses = {"mlm_loss": 0.0, "sop_loss": 0.0}, 0, losses

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        mlm = outputs.mlm_loss.item()
        self._sums["mlm_loss"] += mlm
        self._sums["sop_loss"] += outputs.sop_loss.item()
        self._count += 1
        self.losses.add(mlm)
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    def log(self, logs, *args, **kwargs):
        if self._count and "loss" in logs:
            logs.update({name: round(value / self._count, 4) for name, value in self._sums.items()})
            self._sums, self._count = dict.fromkeys(self._sums, 0.0), 0
        super().log(logs, *args, **kwargs)


class JsonlMetrics(TrainerCallback):
    """Appends every logged dict to LOGGING_DIR/metrics.jsonl (readable offline, no wandb needed)."""

    def __init__(self, folder: str):
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, "metrics.jsonl")

    def on_log(self, args, state, control, logs=None, **kwargs):
        import json

        with open(self.path, "a") as f:
            f.write(json.dumps({"step": state.global_step, **(logs or {})}) + "\n")


def check_arguments(args: AlbertTrainingArguments, collab: CollaborationArguments) -> None:
    """Refuse flags that cannot work before loading the model or joining the swarm."""
    from plexus.cli import checks

    for flag in ("initial_peers", "host_maddrs", "announce_maddrs"):
        checks.check_flag(flag, getattr(collab, flag), checks.multiaddr)
    checks.check_flag("target_batch_size", collab.target_batch_size, checks.positive_int)
    checks.check_flag("per_device_train_batch_size", args.per_device_train_batch_size, checks.positive_int)
    checks.check_flag("matchmaking_time", collab.matchmaking_time, checks.positive_float)
    checks.check_flag("averaging_timeout", collab.averaging_timeout, checks.positive_float)
    if not 0 <= collab.batch_size_lead < collab.target_batch_size:
        raise UsageError(
            f"--batch_size_lead {collab.batch_size_lead} must be at least 0 and below "
            f"--target_batch_size {collab.target_batch_size}"
        )


def main(argv: list[str] | None = None):
    parser = HfArgumentParser(
        (AlbertTrainingArguments, CollaborationArguments, DatasetArguments), description=__doc__
    )
    args, collab, data_args = parser.parse_args_into_dataclasses(args=argv)
    check_arguments(args, collab)
    from plexus.utils.logging import use_plexus_log_handler

    use_plexus_log_handler()
    if args.fp16 and not torch.cuda.is_available():
        logger.warning("--fp16 needs a GPU (on CPU it is several times slower); training in fp32")
        args.fp16 = False
    stop_on_signals()

    dataset = PretrainingDataset(data_args.dataset_path)
    config = load_config(data_args.config, dataset.meta["vocab_size"], dataset.seq_length)
    checkpoint = (
        None
        if args.overwrite_output_dir or not os.path.isdir(args.output_dir)
        else get_last_checkpoint(args.output_dir)
    )
    transformers.set_seed(args.seed)  # every peer starts from the same initial model
    if checkpoint:
        # loaded before the optimizer exists: it copies the parameters it will update from the model
        model = AlbertForMaskedOnlyPreTraining.from_pretrained(checkpoint, local_files_only=True)
    else:
        model = AlbertForMaskedOnlyPreTraining(config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        data_args.tokenizer_path or os.path.join(data_args.dataset_path, "tokenizer"), local_files_only=True
    )

    dht = None
    if collab.local:
        optimizer = local_optimizer_factory(args)(parameter_groups(model, args.weight_decay))
        optimizers = (optimizer, scheduler_factory(args)(optimizer))
        seed, callbacks = args.seed, []
    else:
        import plexus

        dht = plexus.DHT(
            initial_peers=collab.initial_peers,
            start=True,
            host_maddrs=collab.host_maddrs,
            announce_maddrs=collab.announce_maddrs,
            identity_path=collab.identity_path,
            client_mode=collab.client_mode,
            use_ipfs=collab.use_ipfs,
        )
        validators, subkey = make_validators(collab.run_id, dht.private_key)
        dht.add_validators(validators)
        if collab.client_mode:
            logger.info(f"Peer {dht.peer_id} is up in client mode (it dials out and accepts no connections)")
        else:
            addresses = " ".join(str(addr) for addr in dht.get_visible_maddrs())
            logger.info(
                f"Peer {dht.peer_id} is up. To connect other peers to this one, use "
                f"--initial_peers {addresses}"
            )
        optimizer = make_swarm_optimizer(model, args, collab, dht)
        optimizers = (optimizer, NoOpScheduler(optimizer))
        seed = peer_seed(dht.peer_id.to_bytes())
    losses = LossMeter()
    if dht is not None:
        callbacks = [
            SwarmCallback(
                dht=dht,
                optimizer=optimizer,
                model=model,
                run_id=collab.run_id,
                subkey=subkey,
                client_mode=collab.client_mode,
                batch_size_per_step=batch_size_per_step(args),
                losses=losses,
                statistics_expiration=collab.statistics_expiration,
            )
        ]
    logger.info(
        f"{data_args.config} ALBERT, {count_parameters(model) / 1e6:.2f} M parameters; {len(dataset)} samples "
        f"of {dataset.seq_length} tokens{f'; resuming from {checkpoint}' if checkpoint else ''}"
    )

    # each peer reads (and masks) the data in its own order: identical batches would add nothing
    torch.manual_seed(seed)
    trainer = PretrainingTrainer(
        model=model,
        args=args,
        train_dataset=PeerShuffledStream(dataset, seed=seed),
        data_collator=MaskingCollator.from_meta(dataset.meta, generator=torch.Generator().manual_seed(seed)),
        processing_class=tokenizer,
        optimizers=optimizers,
        callbacks=[JsonlMetrics(args.logging_dir), *callbacks],
        losses=losses,
    )
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
    except KeyboardInterrupt:
        logger.info("Interrupted; leaving the swarm")
    finally:
        if dht is not None:
            optimizer.shutdown()
            dht.shutdown()


if __name__ == "__main__":
    from plexus.cli.errors import exit_with

    exit_with(main)
