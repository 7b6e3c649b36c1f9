"""The house rules a reader relies on: modules of a readable size, docstrings that do not outweigh the code, and
citations that a user of the package can follow (every ``docs/...`` file the code names is in the repository)."""

from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "mpiopt")
sys.path.insert(0, os.path.join(ROOT, "tools"))

import doc_ratio  # noqa: E402

#: The torch front end and the algorithms (base modules and each algorithm's own) are where a newcomer reads first.
STRICTER = {"torch": 400, "algorithms": 400}


def modules():
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def limit(path: str) -> int:
    return STRICTER.get(os.path.relpath(path, PACKAGE).split(os.sep)[0], 500)


def test_no_module_is_over_its_size():
    over = []
    for path in modules():
        with open(path) as f:
            lines = sum(1 for _ in f)
        if lines > limit(path):
            over.append(f"{os.path.relpath(path, ROOT)}: {lines} lines > {limit(path)}")
    assert not over, "\n".join(over)


def test_docstrings_and_comments_are_at_most_0_40_of_the_code():
    import pathlib

    counts = [doc_ratio.count(pathlib.Path(p)) for p in modules()]
    docs, comments, code = (sum(c[i] for c in counts) for i in range(3))
    assert (docs + comments) / code <= 0.40, f"docstring {docs} + comment {comments} lines against code {code}"


def test_the_code_cites_only_documents_in_the_repository():
    missing = []
    for path in modules():
        with open(path) as f:
            text = f.read()
        if "ALGORITHMS.md" in text:
            missing.append(f"{os.path.relpath(path, ROOT)} cites ALGORITHMS.md, which is not in the repository")
        for cited in set(re.findall(r"docs/[\w./-]+\.md", text)):
            if not os.path.exists(os.path.join(ROOT, cited)):
                missing.append(f"{os.path.relpath(path, ROOT)} cites {cited}, which does not exist")
    assert not missing, "\n".join(missing)
