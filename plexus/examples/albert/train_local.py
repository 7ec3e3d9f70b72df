#!/usr/bin/env python3
"""Pre-train a tiny ALBERT in one process, with no swarm: the baseline a collaboration must beat.

    python make_demo_corpus.py && python tokenize_corpus.py   # once, ~1 minute
    python train_local.py                                     # 100 steps of 128 samples, ~2 minutes
    python train_local.py --threads 2 --max_steps 300 --out_dir outputs/local

Plain PyTorch: AdamW, linear warm-up then linear decay, gradient clipping, one loop. It prints the
MLM and sentence-order losses; plot MLM (SOP stays near chance, 0.69, for a long while). On the
demo corpus MLM falls from ~9 to below 7 within a few dozen steps.
"""

import math
import os
import time

import torch

from plexus.errors import UsageError

# -- data --
data_dir = "data/albert_tokenized"  # output of tokenize_corpus.py
seed = 0  # seeds the model's initialisation, the data order and the masks
# -- model --
preset = "tiny"  # tiny or large (see model.py)
# -- optimisation --
batch_size = 128  # samples per optimizer step
gradient_accumulation_steps = 4  # micro-batches per step: 32 samples each run ~2x faster than 128 on CPU
learning_rate = 2e-3  # peak, reached after warmup_steps
warmup_steps = 20  # linear warm-up from 0
total_steps = 1000  # the learning rate decays linearly to 0 at this step
max_steps = 100  # stop after this many optimizer steps
weight_decay = 0.01  # AdamW's, not applied to biases and LayerNorm weights
adam_epsilon = 1e-6  # as ALBERT
max_grad_norm = 1.0  # gradient clipping
# -- system --
threads = 1  # torch CPU threads
log_every = 1  # print every this many steps
out_dir = ""  # save the model and tokenizer here at the end (empty: do not save)


def lr_factor(step: int) -> float:
    """Linear warm-up to 1, then linear decay to 0 at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def main(argv: list[str] | None = None):
    from .flags import apply_flags

    apply_flags(globals(), __doc__, argv)
    from .data import MaskingCollator, PeerShuffledStream, PretrainingDataset
    from .model import count_parameters, make_model, parameter_groups

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    dataset = PretrainingDataset(data_dir)
    meta = dataset.meta
    if batch_size % gradient_accumulation_steps:
        raise UsageError(
            f"--batch_size {batch_size} is not a multiple of "
            f"--gradient_accumulation_steps {gradient_accumulation_steps}"
        )
    micro_batch = batch_size // gradient_accumulation_steps
    collate = MaskingCollator.from_meta(meta, generator=torch.Generator().manual_seed(seed))
    loader = iter(
        torch.utils.data.DataLoader(
            PeerShuffledStream(dataset, seed), batch_size=micro_batch, collate_fn=collate
        )
    )
    model = make_model(preset, meta["vocab_size"], dataset.seq_length)
    optimizer = torch.optim.AdamW(parameter_groups(model, weight_decay), lr=learning_rate, eps=adam_epsilon)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    print(
        f"{preset} ALBERT, {count_parameters(model) / 1e6:.2f} M parameters; {len(dataset)} samples of "
        f"{dataset.seq_length} tokens; {threads} thread(s)"
    )

    model.train()
    samples, start = 0, time.perf_counter()
    for step in range(1, max_steps + 1):
        mlm = sop = 0.0
        for _ in range(gradient_accumulation_steps):
            batch = next(loader)
            out = model(**batch)
            (out.loss / gradient_accumulation_steps).backward()
            mlm += out.mlm_loss.item() / gradient_accumulation_steps
            sop += out.sop_loss.item() / gradient_accumulation_steps
            samples += len(batch["input_ids"])
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if not math.isfinite(mlm):
            raise SystemExit(f"error: loss became {mlm} at step {step}; lower --learning_rate")
        if step % log_every == 0 or step == max_steps:
            elapsed = time.perf_counter() - start
            print(
                f"step {step:5d} | mlm {mlm:.4f} | sop {sop:.4f} | lr {scheduler.get_last_lr()[0]:.2e} | "
                f"{samples / elapsed:.1f} samples/s | {elapsed:.0f} s",
                flush=True,
            )

    if out_dir:
        model.save_pretrained(out_dir)
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(
            os.path.join(data_dir, "tokenizer"), local_files_only=True
        ).save_pretrained(out_dir)
        print(f"saved the model and tokenizer to {out_dir}")


if __name__ == "__main__":
    from plexus.cli.errors import exit_with

    exit_with(main)
