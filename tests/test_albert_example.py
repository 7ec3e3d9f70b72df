"""The ALBERT example's data pipeline, model and scripts, on small inputs (no swarm involved).

Scripts run as subprocesses, the way users run them; their building blocks are also imported
directly (from plexus.examples.albert) to check invariants on many cases quickly.
"""

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "albert")
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "albert")

from plexus.errors import UsageError  # noqa: E402
from plexus.examples.albert import corpus, data, tokenize_corpus  # noqa: E402
from plexus.examples.albert import model as albert_model  # noqa: E402

SCRIPTS = [
    "make_demo_corpus.py",
    "tokenize_corpus.py",
    "train_local.py",
    "run_trainer.py",
    "run_training_monitor.py",
    "run_demo.py",
]


def run_script(name: str, *args: str, cwd: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run(
        [sys.executable, os.path.join(EXAMPLE, name), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory) -> str:
    """The fixture corpus (a .txt folder and a WikiText file) tokenized with a small BPE, 32 tokens."""
    out = str(tmp_path_factory.mktemp("albert") / "tokenized")
    result = run_script(
        "tokenize_corpus.py",
        "--input_path",
        FIXTURES,
        "--output_dir",
        out,
        "--tokenizer_type",
        "bpe",
        "--vocab_size",
        "300",
        "--seq_length",
        "32",
        "--seed",
        "1",
        cwd=EXAMPLE,
    )
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.timeout(60)
def test_tokenized_rows_are_well_formed_sentence_order_pairs(tokenized):
    meta = json.load(open(os.path.join(tokenized, "meta.json")))
    arrays = {
        name: np.load(os.path.join(tokenized, f"{name}.npy"), mmap_mode="r")
        for name in data.COLUMNS + (data.LABEL,)
    }
    n = meta["samples"]
    assert n >= 20 and meta["documents"] == 7  # five .txt documents and two WikiText articles
    for name in data.COLUMNS:
        assert arrays[name].shape == (n, 32)
    assert arrays[data.LABEL].shape == (n,)
    cls, sep, pad = meta["cls_token_id"], meta["sep_token_id"], meta["pad_token_id"]
    for row in range(n):
        ids, types = arrays["input_ids"][row], arrays["token_type_ids"][row]
        length = int(arrays["attention_mask"][row].sum())
        assert (arrays["attention_mask"][row][:length] == 1).all() and (
            arrays["attention_mask"][row][length:] == 0
        ).all()
        seps = np.flatnonzero(ids[:length] == sep)
        assert ids[0] == cls and len(seps) == 2 and seps[1] == length - 1 and 1 < seps[0] < length - 2
        assert (
            (types[: seps[0] + 1] == 0).all()
            and (types[seps[0] + 1 : length] == 1).all()
            and (types[length:] == 0).all()
        )
        assert (ids[length:] == pad).all()
        special = np.zeros(32, np.uint8)
        special[[0, seps[0], seps[1]]] = 1
        special[length:] = 1
        assert (arrays["special_tokens_mask"][row] == special).all()
    labels = np.asarray(arrays[data.LABEL])
    assert set(labels.tolist()) == {0, 1}

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(tokenized, "tokenizer"), local_files_only=True)
    assert "token_type_ids" in tokenizer.model_input_names
    assert tokenizer.mask_token_id == meta["mask_token_id"] and len(tokenizer) == meta["vocab_size"]
    text = " ".join(tokenizer.decode(arrays["input_ids"][row], skip_special_tokens=True) for row in range(n))
    assert "the garden behind" in text and "well-known island" in text and "(mostly bakeries)" in text


@pytest.mark.timeout(10)
def test_pairs_are_adjacent_runs_of_one_document_within_budget():
    rng = random.Random(0)
    for _trial in range(300):
        counter = iter(range(10**6))  # token ids are positions, so adjacency is checkable
        document = [[next(counter) for _ in range(rng.randint(0, 40))] for _ in range(rng.randint(1, 12))]
        budget = rng.randint(4, 60)
        pairs = tokenize_corpus.make_pairs(document, budget, 0.1, rng)
        for first, second, swapped in pairs:
            a, b = (second, first) if swapped else (first, second)
            assert a and b and len(a) + len(b) <= budget
            run = a + b
            assert run == list(range(run[0], run[0] + len(run)))  # consecutive text, A before B
    swaps = [s for _, _, s in tokenize_corpus.make_pairs([[i] for i in range(20000)], 8, 0.0, rng)]
    assert 0.45 < sum(swaps) / len(swaps) < 0.55


@pytest.mark.timeout(10)
def test_wikitext_articles_and_saved_datasets_become_documents(tmp_path):
    wiki = list(corpus.read_documents(os.path.join(FIXTURES, "wiki.train.raw")))
    assert len(wiki) == 2  # one per " = Title = "; the " = = Geography = = " section stays inside
    assert wiki[0][1] == "It is about 3.5 kilometres long and has a well-known island in the middle."
    assert wiki[1][-1] == "Several of them are now shops (mostly bakeries)."
    assert not any("Geography" in sentence for sentence in wiki[0])

    datasets = pytest.importorskip("datasets")
    rows = ["First document. It has two sentences.", "Second document here. Also two."]
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(tmp_path / "saved"))
    assert list(corpus.read_documents(str(tmp_path / "saved"))) == [
        ["First document.", "It has two sentences."],
        ["Second document here.", "Also two."],
    ]
    with pytest.raises(UsageError, match="text_column"):
        list(corpus.read_documents(str(tmp_path / "saved"), text_column="body"))


@pytest.mark.timeout(10)
def test_missing_input_says_what_to_pass(tmp_path):
    with pytest.raises(UsageError, match="make_demo_corpus.py"):
        corpus.check_input(str(tmp_path / "nowhere"))
    with pytest.raises(UsageError, match="no .txt or .raw files"):
        corpus.check_input(str(tmp_path))


@pytest.mark.timeout(60)
def test_demo_corpus_is_deterministic_english_prose_with_a_licence_note(tmp_path):
    outputs = []
    for name in ("one", "two"):
        result = run_script(
            "make_demo_corpus.py",
            "--output_dir",
            str(tmp_path / name),
            "--packages",
            "",
            "--max_megabytes",
            "0.15",
            cwd=str(tmp_path),
        )
        assert result.returncode == 0, result.stderr
        outputs.append(open(tmp_path / name / "corpus.txt", encoding="utf-8").read())
    assert outputs[0] == outputs[1]
    text = outputs[0]
    assert len(text.encode()) > 0.15 * 2**20
    lines = [line for line in text.splitlines() if line]
    assert len(lines) > 500 and "" in text.splitlines()  # paragraphs, and blank lines between documents
    assert not any(line.startswith((">>>", "...", "    ")) for line in lines)
    words = text.split()
    common = {"the", "a", "is", "of", "to", "and", "in", "that", "it", "be"}
    assert sum(w.lower() in common for w in words) > 0.1 * len(words)  # English, not code
    assert "PSF" in open(tmp_path / "one" / "NOTICE").read()


@pytest.mark.timeout(30)
def test_collator_masks_ordinary_tokens_80_10_10():
    n, length, vocab = 64, 128, 1000
    ids = torch.randint(5, vocab, (n, length))
    ids[:, 0], ids[:, 60], ids[:, 100] = 2, 3, 3
    special = torch.zeros(n, length, dtype=torch.long)
    special[:, [0, 60, 100]] = 1
    special[:, 101:] = 1
    ids[:, 101:] = 0
    rows = [
        dict(
            input_ids=ids[i],
            token_type_ids=torch.zeros(length, dtype=torch.long),
            attention_mask=(torch.arange(length) <= 100).long(),
            special_tokens_mask=special[i],
            sentence_order_label=torch.tensor(i % 2),
        )
        for i in range(n)
    ]
    collate = data.MaskingCollator(
        mask_token_id=4, vocab_size=vocab, first_ordinary_id=5, generator=torch.Generator().manual_seed(0)
    )
    batch = collate(rows)
    assert batch["input_ids"].shape == (n, 101)  # trimmed to the longest row
    chosen = batch["labels"] != -100
    ordinary = special[:, :101] == 0
    assert not (chosen & ~ordinary).any()
    assert 0.13 < chosen.sum() / ordinary.sum() < 0.17
    assert (batch["labels"][chosen] == ids[:, :101][chosen]).all()
    masked = batch["input_ids"][chosen] == 4
    kept = batch["input_ids"][chosen] == ids[:, :101][chosen]
    assert 0.75 < masked.float().mean() < 0.85 and 0.07 < kept.float().mean() < 0.14
    assert (batch["input_ids"][~chosen] == ids[:, :101][~chosen]).all()
    assert batch["sentence_order_label"].tolist() == [i % 2 for i in range(n)]


@pytest.mark.timeout(30)
def test_masked_only_head_gives_stock_albert_losses_and_gradients(tokenized):
    from transformers import AlbertForPreTraining

    torch.manual_seed(0)
    dataset = data.PretrainingDataset(tokenized)
    batch = data.MaskingCollator.from_meta(dataset.meta, generator=torch.Generator().manual_seed(0))(
        [dataset[i] for i in range(8)]
    )
    fast = albert_model.make_model("tiny", dataset.meta["vocab_size"], dataset.seq_length)
    stock = AlbertForPreTraining(fast.config)
    stock.load_state_dict(fast.state_dict())
    fast.eval(), stock.eval()  # the SOP head has dropout (classifier_dropout_prob); gradients still flow
    out = fast(**batch)
    out.loss.backward()
    reference = stock(**batch)
    reference.loss.backward()
    assert torch.isfinite(out.loss) and out.masked_tokens > 0
    assert torch.allclose(out.loss, reference.loss, atol=1e-5)
    assert abs(out.sop_loss.item() - 0.69) < 0.1  # two classes, untrained
    for (name, p), q in zip(fast.named_parameters(), stock.parameters()):
        assert p.grad is not None, name
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name


@pytest.mark.timeout(10)
def test_each_peer_reads_its_own_order_of_every_row():
    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return i

    def first(seed, count):
        stream = iter(data.PeerShuffledStream(Rows(), seed))
        return [next(stream) for _ in range(count)]

    assert sorted(first(1, 10)) == list(range(10)) and sorted(first(1, 20)[10:]) == list(range(10))
    assert first(1, 20) == first(1, 20) and first(1, 10) != first(2, 10)
    assert first(1, 10) != first(1, 20)[10:]  # a new order every epoch


@pytest.mark.timeout(60)
def test_train_local_runs_and_reports_losses(tokenized, tmp_path):
    result = run_script(
        "train_local.py",
        "--data_dir",
        tokenized,
        "--max_steps",
        "3",
        "--batch_size",
        "8",
        "--gradient_accumulation_steps",
        "2",
        "--out_dir",
        str(tmp_path / "model"),
        cwd=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    assert "step     3 | mlm" in result.stdout
    assert os.path.exists(tmp_path / "model" / "config.json") and os.path.exists(
        tmp_path / "model" / "tokenizer.json"
    )


@pytest.mark.timeout(90)
def test_run_trainer_local_mode_trains_and_logs_mlm_separately(tokenized, tmp_path):
    pytest.importorskip("accelerate")
    result = run_script(
        "run_trainer.py",
        "--local",
        "--dataset_path",
        tokenized,
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--logging_steps",
        "1",
        "--save_steps",
        "1000",
        "--output_dir",
        str(tmp_path / "outputs"),
        "--logging_dir",
        str(tmp_path / "logs"),
        "--disable_tqdm",
        "true",
        cwd=str(tmp_path),
        timeout=80,
    )
    assert result.returncode == 0, result.stderr
    logs = [json.loads(line) for line in open(tmp_path / "logs" / "metrics.jsonl")]
    assert [entry["step"] for entry in logs if "mlm_loss" in entry] == [1, 2]
    assert all(entry["mlm_loss"] > 0 and entry["sop_loss"] > 0 for entry in logs if "mlm_loss" in entry)


@pytest.mark.timeout(90)
def test_run_trainer_says_when_no_initial_peer_answers(tokenized, tmp_path):
    pytest.importorskip("accelerate")
    unreachable = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWEvvWortnaSePcHVKBND3Gvx6tJMFkhU2uXNwZLds7jjk"
    result = run_script(
        "run_trainer.py",
        "--dataset_path",
        tokenized,
        "--initial_peers",
        unreachable,
        "--output_dir",
        str(tmp_path / "outputs"),
        cwd=str(tmp_path),
        timeout=80,
    )
    assert result.returncode != 0 and "could not reach any initial peer" in result.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script, tmp_path):
    result = run_script(script, "--help", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout and "python " in result.stdout  # the docstring with its commands
