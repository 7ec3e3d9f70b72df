#!/usr/bin/env python3
"""Turn local text into ALBERT pre-training pairs, stored as memory-mappable arrays.

    python make_demo_corpus.py && python tokenize_corpus.py          # demo: ~5 MB of docs, ~1 minute
    python tokenize_corpus.py --input_path wikitext-103-raw/wiki.train.raw --seq_length 512 \\
        --output_dir data/albert_tokenized_wikitext --tokenizer_type bpe --vocab_size 30000
    python tokenize_corpus.py --input_path my_saved_dataset --tokenizer_path my_albert_tokenizer

Input: a folder of .txt files, a WikiText-103 raw file, or a dataset saved with `datasets`
(see corpus.py for how each is read). Nothing is downloaded.

Tokenizer: the one in --tokenizer_path (a folder for AutoTokenizer, e.g. a saved albert-large-v2
tokenizer), or else a new one trained here on the corpus with `tokenizers` (an uncased Unigram
model like ALBERT's SentencePiece, or BPE, which trains ~10x faster on large corpora).

Each sample is ALBERT's sentence-order-prediction pair `[CLS] A [SEP] B [SEP]`: A and B are runs of
consecutive sentences from one document; with probability 0.5 they are swapped and
sentence_order_label is 1. As in BERT, 10% of samples are shorter than seq_length on purpose.
Masking for MLM is not done here but by each trainer, afresh for every batch (data.py).
"""

import json
import os
import random
import shutil
import time

import numpy as np

from plexus.errors import UsageError

# -- input --
input_path = "data/demo_corpus"  # folder of .txt files, a WikiText-103 .raw file, or a saved dataset
input_format = "auto"  # auto, text, wikitext or disk
split = "train"  # split to read from a saved DatasetDict
text_column = "text"  # column to read from a saved dataset
max_documents = 0  # read only this many documents (0: all), for quick trials
# -- tokenizer --
tokenizer_path = ""  # folder of an existing tokenizer; empty: train one on the corpus
tokenizer_type = "unigram"  # unigram or bpe, when training one
vocab_size = 8000  # vocabulary size, when training one
tokenizer_sample_megabytes = 100.0  # train the tokenizer on at most this much text
# -- samples --
output_dir = "data/albert_tokenized"  # where the arrays, meta.json and tokenizer/ go
seq_length = 128  # tokens per sample, with [CLS] and two [SEP] (ALBERT-large used 512)
short_seq_prob = 0.1  # share of samples deliberately shorter, so the model also sees short inputs
seed = 0  # seed for pair boundaries, swaps and short lengths

SPECIAL_TOKENS = ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"]  # ALBERT's, in ALBERT's id order
DOCUMENTS_PER_BATCH = 512  # documents tokenized together (tokenizers uses threads within a batch)


def train_tokenizer(texts, kind: str, size: int):
    """An uncased tokenizer trained on `texts`, wrapped for transformers with ALBERT's special tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "unigram":
        tokenizer = Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(
            vocab_size=size, special_tokens=SPECIAL_TOKENS, unk_token="<unk>", show_progress=False
        )
    elif kind == "bpe":
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=SPECIAL_TOKENS, show_progress=False)
    else:
        raise UsageError(f"unknown --tokenizer_type {kind!r}; use unigram or bpe")
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(texts, trainer)
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    # Only for users calling tokenizer(a, b) later: this script builds pairs itself.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    # transformers 5 drops token_type_ids unless they are named here, and ALBERT would get all zeros.
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        pad_token="<pad>",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise UsageError(
            f"--tokenizer_path {path!r} is not a folder. Pass a folder saved with "
            f"save_pretrained (tokenizer.json or spiece.model inside), or leave it empty to train one"
        )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    missing = [
        name
        for name in ("cls_token", "sep_token", "mask_token", "pad_token")
        if getattr(tokenizer, name) is None
    ]
    if missing:
        raise UsageError(
            f"the tokenizer in {path!r} has no {', '.join(missing)}; ALBERT needs "
            f"[CLS], [SEP], [MASK] and a padding token"
        )
    return tokenizer


def encode(tokenizer, sentences: list[str]) -> list[list[int]]:
    if hasattr(tokenizer, "backend_tokenizer"):  # fast path: Rust, threaded, no Python per token
        return [e.ids for e in tokenizer.backend_tokenizer.encode_batch(sentences, add_special_tokens=False)]
    return tokenizer(sentences, add_special_tokens=False)["input_ids"]


def make_pairs(document: list[list[int]], max_tokens: int, short_seq_prob: float, rng: random.Random):
    """Cut one tokenized document into (A, B, swapped) pairs with len(A) + len(B) <= max_tokens.

    Sentences are gathered until they fill a target length or the document ends. The gathered run
    is split at a random sentence boundary (mid-sentence if it is a single sentence), then the longer
    side is trimmed away from the A|B boundary so the two halves stay adjacent in the text.
    """

    def new_target():
        return rng.randint(2, max_tokens) if rng.random() < short_seq_prob else max_tokens

    pairs, run, length, target = [], [], 0, new_target()
    for i, sentence in enumerate(document):
        if not sentence:
            continue
        run.append(sentence)
        length += len(sentence)
        if length < target and i < len(document) - 1:
            continue
        if len(run) >= 2:
            cut = rng.randint(1, len(run) - 1)
            a, b = sum(run[:cut], []), sum(run[cut:], [])
        else:
            tokens = run[0]
            cut = rng.randint(1, len(tokens) - 1) if len(tokens) >= 2 else 0
            a, b = tokens[:cut], tokens[cut:]
        len_a, len_b = len(a), len(b)
        while len_a + len_b > max_tokens:  # longest first, as BERT does
            if len_a > len_b:
                len_a -= 1
            else:
                len_b -= 1
        a, b = a[len(a) - len_a :], b[:len_b]
        if a and b:
            swapped = rng.random() < 0.5
            pairs.append((b, a, True) if swapped else (a, b, False))
        run, length, target = [], 0, new_target()
    return pairs


class ArrayWriter:
    """Appends fixed-length rows to raw files, then wraps them as .npy without loading them."""

    def __init__(self, folder: str, seq_length: int, id_dtype):
        self.folder, self.seq_length, self.rows = folder, seq_length, 0
        self.dtypes = {
            "input_ids": id_dtype,
            "token_type_ids": np.uint8,
            "attention_mask": np.uint8,
            "special_tokens_mask": np.uint8,
            "sentence_order_label": np.uint8,
        }
        self.files = {name: open(os.path.join(folder, f"{name}.tmp"), "wb") for name in self.dtypes}

    def append(self, pairs, cls_id: int, sep_id: int, pad_id: int):
        if not pairs:
            return
        n, width = len(pairs), self.seq_length
        ids = np.full((n, width), pad_id, dtype=self.dtypes["input_ids"])
        types, attention, special = (np.zeros((n, width), np.uint8) for _ in range(3))
        labels = np.zeros(n, np.uint8)
        for row, (a, b, swapped) in enumerate(pairs):
            end_a, end = len(a) + 2, len(a) + len(b) + 3
            ids[row, :end] = [cls_id, *a, sep_id, *b, sep_id]
            types[row, end_a:end] = 1
            attention[row, :end] = 1
            special[row, [0, end_a - 1, end - 1]] = 1
            special[row, end:] = 1
            labels[row] = swapped
        for name, array in zip(self.dtypes, (ids, types, attention, special, labels)):
            self.files[name].write(array.tobytes())
        self.rows += n

    def finish(self):
        for name, dtype in self.dtypes.items():
            self.files[name].close()
            shape = (self.rows, self.seq_length) if name != "sentence_order_label" else (self.rows,)
            header = {
                "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                "fortran_order": False,
                "shape": shape,
            }
            raw = os.path.join(self.folder, f"{name}.tmp")
            with open(os.path.join(self.folder, f"{name}.npy"), "wb") as out, open(raw, "rb") as data:
                np.lib.format.write_array_header_1_0(out, header)
                shutil.copyfileobj(data, out, 16 * 2**20)
            os.remove(raw)


def main(argv: list[str] | None = None):
    from .corpus import check_input, read_documents
    from .flags import apply_flags

    apply_flags(globals(), __doc__, argv)
    check_input(input_path)
    if seq_length < 8:
        raise UsageError(f"--seq_length {seq_length} leaves no room for a pair; use 64 or more")

    def documents():
        for count, document in enumerate(read_documents(input_path, input_format, split, text_column)):
            if max_documents and count >= max_documents:
                return
            yield document

    os.makedirs(output_dir, exist_ok=True)
    start = time.perf_counter()
    if tokenizer_path:
        tokenizer = load_tokenizer(tokenizer_path)
        tokenizer_seconds = 0.0
    else:

        def sample_texts():
            budget = tokenizer_sample_megabytes * 2**20
            for document in documents():
                text = " ".join(document)
                yield text
                budget -= len(text)
                if budget <= 0:
                    return

        tokenizer = train_tokenizer(sample_texts(), tokenizer_type, vocab_size)
        tokenizer_seconds = time.perf_counter() - start
        print(
            f"trained a {tokenizer_type} tokenizer with {len(tokenizer)} tokens in {tokenizer_seconds:.1f} s"
        )
    tokenizer.save_pretrained(os.path.join(output_dir, "tokenizer"))

    cls_id, sep_id, pad_id, mask_id = (
        tokenizer.convert_tokens_to_ids(t)
        for t in (tokenizer.cls_token, tokenizer.sep_token, tokenizer.pad_token, tokenizer.mask_token)
    )
    special_ids = set(tokenizer.all_special_ids)
    # MLM replaces 10% of chosen tokens by random ones, drawn from ids above the specials when these
    # come first (ALBERT's do); otherwise from the whole vocabulary.
    first_ordinary_id = max(special_ids) + 1 if max(special_ids) < len(tokenizer) // 2 else 0
    writer = ArrayWriter(output_dir, seq_length, np.uint16 if len(tokenizer) <= 2**16 else np.int32)
    rng, n_documents, n_tokens, batch = random.Random(seed), 0, 0, []
    tokenize_start = time.perf_counter()

    def flush():
        nonlocal n_tokens
        sentences = [s for document in batch for s in document]
        encoded, pairs, offset = encode(tokenizer, sentences), [], 0
        for document in batch:
            tokens = encoded[offset : offset + len(document)]
            offset += len(document)
            n_tokens += sum(map(len, tokens))
            pairs += make_pairs(tokens, seq_length - 3, short_seq_prob, rng)
        writer.append(pairs, cls_id, sep_id, pad_id)
        batch.clear()

    for document in documents():
        n_documents += 1
        batch.append(document)
        if len(batch) == DOCUMENTS_PER_BATCH:
            flush()
    flush()
    writer.finish()
    if writer.rows == 0:
        raise UsageError(f"{input_path!r} gave no samples: it has no document with two or more tokens")

    meta = dict(
        samples=writer.rows,
        seq_length=seq_length,
        vocab_size=len(tokenizer),
        documents=n_documents,
        tokens=n_tokens,
        cls_token_id=cls_id,
        sep_token_id=sep_id,
        pad_token_id=pad_id,
        mask_token_id=mask_id,
        first_ordinary_id=first_ordinary_id,
        input_path=input_path,
        tokenizer=tokenizer_path or f"trained here: {tokenizer_type}, {vocab_size}",
        seed=seed,
        short_seq_prob=short_seq_prob,
    )
    with open(os.path.join(output_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(
        f"wrote {writer.rows} samples of {seq_length} tokens from {n_documents} documents "
        f"({n_tokens} tokens) to {output_dir} in {time.perf_counter() - tokenize_start:.1f} s"
    )


if __name__ == "__main__":
    from plexus.cli.errors import exit_with

    exit_with(main)
