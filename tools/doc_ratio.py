"""Docstring and comment lines against code lines over a package, and its largest modules.

    python tools/doc_ratio.py [mpiopt] [-v]

A docstring line is a line of a module's, class's or function's docstring; a comment line holds a comment and
no code; a code line holds code.  Blank lines count as none.  ``-v`` lists the modules furthest over 0.40.
"""

from __future__ import annotations

import ast
import io
import pathlib
import sys
import tokenize
from typing import Tuple

_LAYOUT = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER, tokenize.ENCODING)


def count(path: pathlib.Path) -> Tuple[int, int, int]:
    """(docstring, comment, code) lines of one module."""
    source = path.read_text()
    docs = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node, clean=False) is not None:
            docs.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    comments, code = set(), set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments.add(token.start[0])
        elif token.type not in _LAYOUT:
            code.update(range(token.start[0], token.end[0] + 1))
    code -= docs
    return len(docs), len(comments - code - docs), len(code)


def main(argv: list) -> None:
    root = pathlib.Path(next((a for a in argv if not a.startswith("-")), "mpiopt"))
    rows = [(str(p), *count(p), len(p.read_text().splitlines())) for p in sorted(root.rglob("*.py"))]
    docs, comments, code = (sum(r[i] for r in rows) for i in (1, 2, 3))
    if "-v" in argv:
        for name, d, c, k, _ in sorted(rows, key=lambda r: 0.4 * r[3] - r[1] - r[2])[:25]:
            print(f"{(d + c) / max(k, 1):5.2f}  docstring {d:4d}  comment {c:3d}  code {k:4d}  {name}")
    for name, *_, lines in sorted(rows, key=lambda r: -r[4])[:5]:
        print(f"{lines:5d} lines  {name}")
    print(f"docstring {docs} + comment {comments} lines against code {code}: ratio {(docs + comments) / code:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
