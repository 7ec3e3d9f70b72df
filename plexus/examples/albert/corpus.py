"""Read local text as documents: lists of sentences, ready to cut into sentence-order pairs.

Three kinds of input, told apart by `detect_format`:

- "text": .txt files. A blank line ends a document, and so does the end of a file. Inside a
  document, line breaks are just spaces (one paragraph per line, or hard-wrapped prose).
- "wikitext": WikiText-103 raw files (`wiki.train.raw`). An article starts at a ` = Title = `
  line; ` = = Section = = ` headings and blank lines stay inside it. The dataset's tokenisation
  artefacts (` @-@ `, spaces before commas) are undone.
- "disk": a dataset written by `datasets`' `save_to_disk`. Each row of `text_column` is read like
  a text file (usually one document), unless the rows are WikiText lines (as in the hub's
  `wikitext-103-raw-v1`), which are read like a wikitext file.

Sentences are split with a regular expression (end punctuation, space, capital or digit): no nltk
data to download, and good enough for pairs whose boundary only has to fall between sentences.
"""

import os
import re
from collections.abc import Iterable, Iterator

from plexus.errors import UsageError

_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]?\s+(?=[\"'(\[]?[A-Z0-9])")
_WIKI_TITLE = re.compile(r"^ = [^=].* = $")
_WIKI_HEADING = re.compile(r"^ (= )+.* (= )+$")
_WIKI_JOINERS = [(" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", ".")]
_SPACE_BEFORE = re.compile(r" (?=[.,;:!?)'](?:\s|$))|(?<=\() ")

Document = list[str]  # sentences, in order


def split_sentences(text: str) -> list[str]:
    return [s for s in (p.strip() for p in _SENTENCE_END.split(text)) if s]


def _document(paragraphs: list[str]) -> Document:
    return split_sentences(" ".join(paragraphs))


def read_text_lines(lines: Iterable[str]) -> Iterator[Document]:
    paragraphs = []
    for line in lines:
        line = line.strip()
        if line:
            paragraphs.append(line)
        elif paragraphs:
            yield _document(paragraphs)
            paragraphs = []
    if paragraphs:
        yield _document(paragraphs)


def undo_wikitext_tokenization(line: str) -> str:
    for old, new in _WIKI_JOINERS:
        line = line.replace(old, new)
    return _SPACE_BEFORE.sub("", line)


def read_wikitext_lines(lines: Iterable[str]) -> Iterator[Document]:
    paragraphs = []
    for line in lines:
        line = line.rstrip("\n")
        if _WIKI_TITLE.match(line):
            if paragraphs:
                yield _document(paragraphs)
            paragraphs = []
        elif line.strip() and not _WIKI_HEADING.match(line):
            paragraphs.append(undo_wikitext_tokenization(line.strip()))
    if paragraphs:
        yield _document(paragraphs)


def looks_like_wikitext(lines: Iterable[str], probe: int = 200) -> bool:
    for i, line in enumerate(lines):
        if i >= probe:
            break
        if _WIKI_TITLE.match(line.rstrip("\n")):
            return True
    return False


def _is_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, name))
        for name in ("dataset_info.json", "dataset_dict.json", "state.json")
    )


def text_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    found = []
    for folder, dirs, files in os.walk(path):
        dirs.sort()
        found += [os.path.join(folder, f) for f in sorted(files) if f.endswith((".txt", ".raw"))]
    return found


def check_input(path: str) -> None:
    """Raise UsageError, saying what to pass instead, unless `path` holds something we can read."""
    if not os.path.exists(path):
        raise UsageError(
            f"--input_path {path!r} does not exist. Pass a folder of .txt files, "
            f"a WikiText-103 raw file (e.g. wikitext-103-raw/wiki.train.raw), "
            f"or a folder written by datasets' save_to_disk. "
            f"To build the offline demo corpus first, run: python make_demo_corpus.py"
        )
    if not _is_saved_dataset(path) and not text_files(path):
        raise UsageError(
            f"{path!r} holds no .txt or .raw files and is not a saved dataset "
            f"(no dataset_info.json, dataset_dict.json or state.json); pass one of those"
        )


def file_format(name: str) -> str:
    with open(name, encoding="utf-8", errors="replace") as f:
        return "wikitext" if name.endswith(".raw") or looks_like_wikitext(f) else "text"


def _dataset_rows(path: str, split: str, text_column: str) -> Iterable[str]:
    import datasets

    data = datasets.load_from_disk(path)
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise UsageError(
                f"{path!r} has splits {sorted(data)}, not {split!r}; pass --split with one of them"
            )
        data = data[split]
    if text_column not in data.column_names:
        raise UsageError(
            f"{path!r} has columns {data.column_names}, not {text_column!r}; "
            f"pass --text_column with the one holding text"
        )
    return (row[text_column] for row in data)


def read_documents(
    path: str, input_format: str = "auto", split: str = "train", text_column: str = "text"
) -> Iterator[Document]:
    """All documents of the input, in a fixed order; each call reads the input again from the start.

    With input_format "auto", a saved dataset is read as "disk" and each file as "wikitext" or
    "text" by its name (.raw) or by its first lines (a ` = Title = ` line).
    """
    check_input(path)
    if input_format not in ("auto", "text", "wikitext", "disk"):
        raise UsageError(f"unknown --input_format {input_format!r}; use auto, text, wikitext or disk")
    if input_format == "disk" or (input_format == "auto" and _is_saved_dataset(path)):
        if looks_like_wikitext(_dataset_rows(path, split, text_column)):
            yield from read_wikitext_lines(_dataset_rows(path, split, text_column))
        else:
            for row in _dataset_rows(path, split, text_column):
                yield from read_text_lines(row.splitlines())
        return
    for name in text_files(path):
        kind = file_format(name) if input_format == "auto" else input_format
        with open(name, encoding="utf-8", errors="replace") as f:
            yield from (read_wikitext_lines if kind == "wikitext" else read_text_lines)(f)
