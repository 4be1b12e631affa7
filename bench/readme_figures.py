"""The README's figures come from committed result files: each block between ``<!-- results: PATH -->`` and
``<!-- /results -->`` in README.md and docs/*.md is the file PATH (a bench's or the main job's ``results.md``),
word for word. ``--write`` refreshes every block from its file; without it, a block that differs is listed and
the exit status is 1 (tests/test_readme_figures.py runs the check).

    .venv/bin/python bench/readme_figures.py [--write]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- results: (?P<path>\S+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(text: str):
    for m in BLOCK.finditer(text):
        yield m.group("path"), m.group("body")


def stale() -> list[str]:
    """'document: path' for every block whose text is not its file's (or whose file is missing)."""
    bad = []
    for doc in documents():
        for path, body in blocks(doc.read_text()):
            f = ROOT / path
            if not f.is_file():
                bad.append(f"{doc.relative_to(ROOT)}: {path} (no such file)")
            elif body.strip() != f.read_text().strip():
                bad.append(f"{doc.relative_to(ROOT)}: {path} (differs from its file)")
    return bad


def write() -> None:
    for doc in documents():
        text = doc.read_text()
        new = BLOCK.sub(lambda m: m.group(1) + (ROOT / m.group("path")).read_text().strip() + "\n" + m.group(4), text)
        if new != text:
            doc.write_text(new)


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        write()
    bad = stale()
    for b in bad:
        print(b)
    sys.exit(1 if bad else 0)
