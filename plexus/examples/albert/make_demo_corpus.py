#!/usr/bin/env python3
"""Build a small English corpus offline from documentation already on this machine.

    python make_demo_corpus.py                                  # -> data/demo_corpus/corpus.txt (~6 MB)
    python make_demo_corpus.py --max_megabytes 1 --output_dir data/small_corpus

The text is the prose of Python's own documentation (the `pydoc` topics and the standard library's
docstrings, PSF licence) followed by the docstrings of a few installed, permissively licensed
packages (numpy, scipy, torch, transformers). Nothing is downloaded. Source files are read with `ast`,
never imported, so building has no side effects.

Output format (what tokenize_corpus.py reads): one paragraph per line, a blank line between
documents; a document is one module (or one pydoc topic). Code, doctests, parameter tables and
reST headings are removed. A NOTICE beside the corpus says where the text comes from and under
which licences. The same installed versions give the same bytes.
"""

import ast
import importlib.metadata
import os
import re
import sys
import sysconfig
import time

from plexus.errors import UsageError

# -- what to collect --
output_dir = "data/demo_corpus"  # folder for corpus.txt and NOTICE
packages = "numpy,scipy,torch,transformers"  # installed packages whose docstrings come next
max_megabytes = 6.0  # stop once the corpus reaches this size
min_words = 6  # drop shorter paragraphs (signatures, one-word notes)

# Folders never worth reading: test suites, demos, vendored copies.
_SKIP_DIRS = {
    "test",
    "tests",
    "testing",
    "idle_test",
    "turtledemo",
    "site-packages",
    "__pycache__",
    "_vendor",
    "vendored",
    "benchmarks",
    "third_party",
}
_UNDERLINE = re.compile(r"^\s*([-=~*^#+])\1{2,}\s*$")
_ROLE = re.compile(r":[a-zA-Z_:]+:`~?([^`]*)`")  # :func:`foo` -> foo
_MARKUP = re.compile(r"``|\*\*|`_*")
_WORD = re.compile(r"[(\"']*[A-Za-z][A-Za-z'-]*[.,;:!?)\"']*")
_BULLET = re.compile(r"^[*+-] (?=\S)")


def clean_paragraph(lines: list[str]) -> str | None:
    """Return one prose line from a block of docstring lines, or None if the block is not prose."""
    first = lines[0]
    if first.startswith((" ", "\t", ">>>", "...", "$ ", ".. ", "|", "+", "#")):
        return None  # code, doctest, shell, reST directive, table or heading
    if any(_UNDERLINE.match(line) for line in lines):
        return None  # a reST or numpydoc section: heading plus parameter table
    if any(line.startswith((" ", "\t")) for line in lines[1:]):
        return None  # an indented body: "Args:" lists, definitions, examples
    text = " ".join(line.strip() for line in lines)
    text = _MARKUP.sub("", _ROLE.sub(r"\1", text))
    text = re.sub(r"\s+", " ", text).strip()
    words = text.split()
    if len(words) < min_words or not text.endswith((".", "!", "?", ":", ")")) or text.endswith("::"):
        return None
    if sum(bool(_WORD.fullmatch(w)) for w in words) < 0.8 * len(words):
        return None  # mostly identifiers, numbers or symbols
    if sum(c in "{}[]=<>_\\/@|" for c in text) > 0.03 * len(text):
        return None
    return text


def split_bullets(block: list[str]) -> list[list[str]]:
    """Turn a bulleted block ("* item" lines with indented continuations) into one block per item."""
    if not _BULLET.match(block[0]):
        return [block]
    items = []
    for line in block:
        bullet = _BULLET.match(line)
        if bullet:
            items.append([line[bullet.end() :]])
        elif items and line.startswith(" "):
            items[-1].append(line.strip())
        else:
            return [block]  # not a plain list after all
    return items


def paragraphs_of(docstring: str) -> list[str]:
    lines = docstring.expandtabs().splitlines()
    blocks, block = [], []
    for line in lines + [""]:
        if line.strip():
            block.append(line.rstrip())
        elif block:
            blocks.extend(split_bullets(block))
            block = []
    return [p for p in map(clean_paragraph, blocks) if p]


def module_docstrings(path: str) -> list[str]:
    """Docstrings of a module, its classes and functions, in source order, without importing it."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []  # a template or a file for another Python version: not our business
    nodes = [tree] + [
        n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    return [d for d in (ast.get_docstring(n, clean=True) for n in nodes) if d]


def python_files(root: str):
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(".py") and not name.startswith("test_"):
                yield os.path.join(folder, name)


def documents_from_tree(root: str):
    for path in python_files(root):
        yield [p for d in module_docstrings(path) for p in paragraphs_of(d)]


def documents_from_pydoc_topics():
    from pydoc_data.topics import topics  # the Language Reference as plain text, shipped with Python

    for name in sorted(topics):
        yield paragraphs_of(topics[name])


def package_root(name: str) -> str:
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise UsageError(
            f"--packages: {name!r} is not installed; name installed packages (e.g. numpy,torch)"
        ) from None
    root = os.path.join(str(dist.locate_file("")), name)
    if not os.path.isdir(root):
        raise UsageError(
            f"package {name!r} has no source folder at {root}; "
            f"pass --packages with installed pure-Python packages (e.g. numpy,torch)"
        )
    return root


def package_licence(name: str) -> str:
    meta = importlib.metadata.metadata(name)
    classifiers = [c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License")]
    licence = meta.get("License-Expression") or (classifiers[0] if classifiers else meta.get("License", ""))
    return licence.splitlines()[0] if licence else "see the package's metadata"


def main(argv: list[str] | None = None):
    from .flags import apply_flags

    apply_flags(globals(), __doc__, argv)
    names = [p for p in packages.split(",") if p]
    stdlib = sysconfig.get_paths()["stdlib"]
    python = f"Python {sys.version.split()[0]}"
    sources = [
        (f"{python} pydoc topics", "PSF-2.0", documents_from_pydoc_topics()),
        (f"{python} standard library docstrings", "PSF-2.0", documents_from_tree(stdlib)),
    ]
    for name in names:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            raise UsageError(
                f"--packages: {name!r} is not installed; name installed packages (e.g. numpy,torch)"
            ) from None
        sources.append(
            (f"{name} {version} docstrings", package_licence(name), documents_from_tree(package_root(name)))
        )

    os.makedirs(output_dir, exist_ok=True)
    limit, written, seen, used = int(max_megabytes * 2**20), 0, set(), []
    start = time.perf_counter()
    with open(os.path.join(output_dir, "corpus.txt"), "w", encoding="utf-8") as out:
        for label, licence, documents in sources:
            source_bytes = 0
            for paragraphs in documents:
                if written >= limit:
                    break
                fresh = [p for p in paragraphs if p not in seen]  # the same docstring is often inherited
                if not fresh:
                    continue
                seen.update(fresh)
                chunk = "\n".join(fresh) + "\n\n"
                out.write(chunk)
                size = len(chunk.encode())
                written, source_bytes = written + size, source_bytes + size
            if source_bytes:
                used.append((label, licence, source_bytes))
    with open(os.path.join(output_dir, "NOTICE"), "w", encoding="utf-8") as f:
        f.write(
            "corpus.txt was built by make_demo_corpus.py from documentation text installed on this machine.\n"
            "It is a derivative of the following works and is distributed under their licences:\n\n"
        )
        for label, licence, size in used:
            f.write(f"- {label} ({size / 2**20:.2f} MB): {licence}\n")
    print(
        f"wrote {written / 2**20:.2f} MB, {len(seen)} paragraphs to {output_dir}/corpus.txt "
        f"in {time.perf_counter() - start:.1f} s"
    )
    for label, licence, size in used:
        print(f"  {size / 2**20:6.2f} MB  {label}  [{licence}]")


if __name__ == "__main__":
    from plexus.cli.errors import exit_with

    exit_with(main)
