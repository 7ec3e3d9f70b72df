"""The tokenized corpus on disk, a Dataset over it, per-peer shuffling and the MLM masking collator.

tokenize_corpus.py writes one folder that every trainer on a machine shares:

    input_ids.npy             [N, seq_length]  uint16 (int32 if the vocabulary is larger)
    token_type_ids.npy        [N, seq_length]  uint8: 0 for [CLS] A [SEP], 1 for B [SEP], 0 for padding
    attention_mask.npy        [N, seq_length]  uint8: 1 for real tokens
    special_tokens_mask.npy   [N, seq_length]  uint8: 1 for [CLS], [SEP] and padding (never masked)
    sentence_order_label.npy  [N]              uint8: 1 when A and B were swapped
    meta.json                 sizes, special token ids, how it was built
    tokenizer/                the tokenizer, loadable with AutoTokenizer.from_pretrained

The arrays are opened memory-mapped: four trainers on one machine share one copy in the page cache
instead of holding 1 GB or more of Python lists each.
"""

import json
import os

import numpy as np
import torch

from plexus.errors import UsageError

COLUMNS = ("input_ids", "token_type_ids", "attention_mask", "special_tokens_mask")
LABEL = "sentence_order_label"


def read_meta(path: str) -> dict:
    meta_path = os.path.join(path, "meta.json")
    if not os.path.exists(meta_path):
        raise UsageError(
            f"{path!r} is not a tokenized corpus (no meta.json); "
            f"create one with: python tokenize_corpus.py --output_dir {path}"
        )
    with open(meta_path) as f:
        return json.load(f)


class PretrainingDataset(torch.utils.data.Dataset):
    """Rows of the tokenized corpus as dicts of int64 tensors (the arrays stay on disk)."""

    def __init__(self, path: str):
        self.path, self.meta = path, read_meta(path)
        self.arrays = {
            name: np.load(os.path.join(path, f"{name}.npy"), mmap_mode="r") for name in COLUMNS + (LABEL,)
        }
        self.seq_length = self.arrays["input_ids"].shape[1]

    def __len__(self) -> int:
        return len(self.arrays[LABEL])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            name: torch.from_numpy(np.asarray(array[index], dtype=np.int64))
            for name, array in self.arrays.items()
        }


def shuffled_order(size: int, seed: int, epoch: int) -> torch.Tensor:
    """A permutation that depends only on (seed, epoch): each peer passes its own seed."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(size, generator=generator)


class PeerShuffledStream(torch.utils.data.IterableDataset):
    """Endless stream of rows, reshuffled every epoch with this peer's seed.

    Collaborative training has no epochs that peers agree on, and peers that read the corpus in
    the same order would contribute the same gradients: each peer passes its own seed (for
    example derived from its peer id). DataLoader workers take interleaved slices of each epoch.
    """

    def __init__(self, dataset: PretrainingDataset, seed: int, start_epoch: int = 0):
        self.dataset, self.seed, self.start_epoch = dataset, seed, start_epoch

    def __iter__(self):
        worker = torch.utils.data.get_worker_info()
        first, step = (worker.id, worker.num_workers) if worker else (0, 1)
        epoch = self.start_epoch
        while True:
            for index in shuffled_order(len(self.dataset), self.seed, epoch)[first::step].tolist():
                yield self.dataset[index]
            epoch += 1


class MaskingCollator:
    """Stack rows into a batch and mask tokens for MLM, as BERT and ALBERT do.

    Of the tokens that are not special, `mlm_probability` are chosen; of those, 80% become
    [MASK], 10% a random ordinary token and 10% stay as they are. `labels` hold the original id at
    chosen positions and -100 elsewhere. Every call draws fresh masks, so each epoch sees new ones.

    With `trim=True` the batch is cut to its longest row: short documents then cost less compute.
    """

    def __init__(
        self,
        mask_token_id: int,
        vocab_size: int,
        first_ordinary_id: int = 0,
        mlm_probability: float = 0.15,
        trim: bool = True,
        generator: torch.Generator | None = None,
    ):
        self.mask_token_id, self.vocab_size, self.first_ordinary_id = (
            mask_token_id,
            vocab_size,
            first_ordinary_id,
        )
        self.mlm_probability, self.trim, self.generator = mlm_probability, trim, generator

    @classmethod
    def from_meta(cls, meta: dict, **kwargs) -> "MaskingCollator":
        return cls(meta["mask_token_id"], meta["vocab_size"], meta["first_ordinary_id"], **kwargs)

    def __call__(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = {name: torch.stack([row[name] for row in rows]) for name in rows[0]}
        if self.trim:
            length = int(batch["attention_mask"].sum(1).max())
            for name in COLUMNS:
                batch[name] = batch[name][:, :length]
        special = batch.pop("special_tokens_mask").bool()
        inputs = batch["input_ids"].clone()
        chosen = torch.rand(inputs.shape, generator=self.generator) < self.mlm_probability
        chosen &= ~special
        if not chosen.any():  # keep the MLM loss defined: choose one ordinary token
            candidates = (~special).flatten().nonzero()
            if len(candidates):
                chosen.view(-1)[candidates[0]] = True
        labels = torch.where(chosen, inputs, torch.full_like(inputs, -100))
        draw = torch.rand(inputs.shape, generator=self.generator)
        inputs[chosen & (draw < 0.8)] = self.mask_token_id
        randomized = chosen & (draw >= 0.8) & (draw < 0.9)
        inputs[randomized] = torch.randint(
            self.first_ordinary_id, self.vocab_size, inputs.shape, generator=self.generator
        )[randomized]
        batch["input_ids"], batch["labels"] = inputs, labels
        return batch
