#!/usr/bin/env python3
"""Pre-train ALBERT with Hugging Face's Trainer; with --local, alone, without a swarm.

    python run_trainer.py --local --max_steps 200                          # one CPU peer, tiny model
    python run_trainer.py --initial_peers /ip4/1.2.3.4/tcp/1337/p2p/XXXX \\
        --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --model_preset large --fp16

The flags are the tutorial's: every `transformers.TrainingArguments` flag, the swarm flags
(CollaborationArguments) and the data flags (DatasetArguments). Data comes from
tokenize_corpus.py; each peer reads it in its own order (PeerShuffledStream, seeded per peer).

Where the swarm comes in: `make_optimizer` is the one place that builds the optimizer. With
--local it is AdamW with linear warm-up and decay, stepped every batch. Without --local it will be
plexus.Optimizer wrapping the same AdamW, stepping once the whole swarm has accumulated
--target_batch_size samples; until that exists, the script says so and stops.
"""

import json
import os
from dataclasses import dataclass, field

import torch
import transformers
from transformers import HfArgumentParser, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from data import MaskingCollator, PeerShuffledStream, PretrainingDataset  # siblings in examples/albert
from model import count_parameters, make_model, parameter_groups


@dataclass
class CollaborationArguments:
    """How this peer joins the swarm (ignored with --local)."""

    local: bool = field(
        default=False, metadata={"help": "train alone with AdamW, no swarm (a baseline and a smoke test)"}
    )
    run_id: str = field(
        default="albert",
        metadata={"help": "name of the collaboration; peers with the same run_id train together"},
    )
    initial_peers: list[str] = field(
        default_factory=list, metadata={"help": "multiaddresses of peers already in the swarm"}
    )
    use_ipfs: bool = field(
        default=False, metadata={"help": "find initial peers through the IPFS DHT by peer id only"}
    )
    host_maddrs: list[str] = field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"], metadata={"help": "addresses to listen on"}
    )
    announce_maddrs: list[str] = field(
        default_factory=list, metadata={"help": "addresses to tell other peers, if not the listening ones"}
    )
    identity_path: str | None = field(
        default=None,
        metadata={"help": "file with this peer's private key, to keep its peer id across restarts"},
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
    backup_every_steps: int = field(
        default=10, metadata={"help": "keep an in-memory copy of the state every this many steps"}
    )


@dataclass
class DatasetArguments:
    dataset_path: str = field(
        default="data/albert_tokenized", metadata={"help": "output of tokenize_corpus.py"}
    )
    tokenizer_path: str = field(
        default="", metadata={"help": "tokenizer to save with checkpoints (default: DATASET_PATH/tokenizer)"}
    )
    model_preset: str = field(
        default="tiny", metadata={"help": "tiny (demo) or large (albert-large-v2's shape)"}
    )


@dataclass
class AlbertTrainingArguments(TrainingArguments):
    """TrainingArguments with this example's defaults, plus flags the tutorial uses."""

    per_device_train_batch_size: int = 32
    gradient_accumulation_steps: int = 1
    learning_rate: float = 2e-3  # for the tiny model with AdamW; ALBERT-large with LAMB used 1.76e-3
    warmup_steps: int = 20
    total_steps: int = field(
        default=1000, metadata={"help": "the learning rate decays linearly to 0 at this step"}
    )
    adam_epsilon: float = 1e-6
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    max_steps: int = 10**9  # collaborative training runs until stopped
    logging_steps: int = 10
    logging_first_step: bool = True
    save_steps: int = 500
    save_total_limit: int | None = 2
    output_dir: str = "outputs"
    logging_dir: str = field(default="logs", metadata={"help": "metrics.jsonl goes here"})
    overwrite_output_dir: bool = field(
        default=True,
        metadata={
            "help": "start a fresh model; with --overwrite_output_dir false, "
            "resume from the newest checkpoint in OUTPUT_DIR"
        },
    )
    remove_unused_columns: bool = (
        False  # the collator needs special_tokens_mask, which forward() does not take
    )
    label_names: list[str] | None = field(default_factory=lambda: ["labels", "sentence_order_label"])
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = torch.cuda.is_available()


def make_optimizer(model, args: AlbertTrainingArguments, collab: CollaborationArguments):
    """The optimizer and its schedule: the single place to switch from local AdamW to the swarm."""
    optimizer = torch.optim.AdamW(
        parameter_groups(model, args.weight_decay),
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
    )
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, args.warmup_steps, args.total_steps)
    if collab.local:
        return optimizer, scheduler
    # Next: plexus.Optimizer(run_id=collab.run_id, optimizer=optimizer, scheduler=scheduler,
    #   target_batch_size=collab.target_batch_size - collab.batch_size_lead, batch_size_per_step=
    #   args.per_device_train_batch_size * args.gradient_accumulation_steps * max(1, args.n_gpu), ...),
    # returned with a scheduler that does nothing (the swarm optimizer steps the real one).
    raise SystemExit(
        "error: collaborative training needs plexus.Optimizer, which is not available yet; "
        "run with --local to train alone"
    )


class PretrainingTrainer(Trainer):
    """Trainer that also logs the MLM and SOP losses separately (plot MLM: SOP stays near 0.69 for long)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sums, self._count = {"mlm_loss": 0.0, "sop_loss": 0.0}, 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        self._sums["mlm_loss"] += outputs.mlm_loss.item()
        self._sums["sop_loss"] += outputs.sop_loss.item()
        self._count += 1
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
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": state.global_step, **(logs or {})}) + "\n")


def main(argv: list[str] | None = None):
    parser = HfArgumentParser(
        (AlbertTrainingArguments, CollaborationArguments, DatasetArguments), description=__doc__
    )
    args, collab, data_args = parser.parse_args_into_dataclasses(args=argv)
    transformers.set_seed(args.seed)
    dataset = PretrainingDataset(data_args.dataset_path)
    model = make_model(data_args.model_preset, dataset.meta["vocab_size"], dataset.seq_length)
    checkpoint = (
        None
        if args.overwrite_output_dir or not os.path.isdir(args.output_dir)
        else get_last_checkpoint(args.output_dir)
    )
    resuming = f"; resuming from {checkpoint}" if checkpoint else ""
    print(
        f"{data_args.model_preset} ALBERT, {count_parameters(model) / 1e6:.2f} M parameters; "
        f"{len(dataset)} samples of {dataset.seq_length} tokens{resuming}"
    )

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        data_args.tokenizer_path or os.path.join(data_args.dataset_path, "tokenizer"), local_files_only=True
    )
    # Each peer must read its own order; in the swarm this seed will come from the peer id.
    stream = PeerShuffledStream(dataset, seed=args.seed)
    trainer = PretrainingTrainer(
        model=model,
        args=args,
        train_dataset=stream,
        data_collator=MaskingCollator.from_meta(dataset.meta),
        processing_class=tokenizer,
        optimizers=make_optimizer(model, args, collab),
        callbacks=[JsonlMetrics(args.logging_dir)],
    )
    trainer.train(resume_from_checkpoint=checkpoint)


if __name__ == "__main__":
    main()
