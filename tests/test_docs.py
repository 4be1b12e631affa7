"""Every command, path and link that README.md and docs/*.md name exists: the project's commands answer
``--help`` (the ``evoharness`` subcommands, ``python -m evoharness.cli``, the bench and scripts' Python files),
the tools' commands (dvc, prefect, mlflow) answer ``--help`` for the subcommand named, the scripts run with bash
exist, every repository path in a code span or code block exists, and every relative link resolves."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOTS = ("evoharness", "flows", "tasks", "bench", "scripts", "configs", "docs", "tests", "ablation", ".ci")
TOOLS = ("dvc", "prefect", "mlflow")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def code_texts(md: str) -> list[str]:
    """The code spans and the lines of fenced code blocks of a markdown text."""
    out, fence = [], False
    for line in md.splitlines():
        if line.strip().startswith("```"):
            fence = not fence
            continue
        if fence:
            out.append(line.split("  #")[0])
        else:
            out += re.findall(r"`([^`]+)`", line)
    return out


def named(md: str) -> dict[str, set]:
    """What a document names: ``evoharness`` subcommands, Python files run, tool subcommands, bash scripts, paths, links."""
    found: dict[str, set] = {"sub": set(), "module": set(), "pyfile": set(), "tool": set(), "bash": set(), "path": set(), "link": set()}
    for text in code_texts(md):
        for part in re.split(r"&&|;|\|", text):
            words = part.split()
            for i, w in enumerate(words):
                name = w.rsplit("/", 1)[-1]
                rest = words[i + 1:]
                if name == "evoharness" and rest and re.fullmatch(r"[a-z][a-z-]*", rest[0]) and (i > 0 or "/" in w or len(words) > 1):
                    found["sub"].add(rest[0])
                elif name in ("python", "python3") and rest:
                    if rest[0] == "-m" and len(rest) > 1 and rest[1].startswith("evoharness"):
                        found["module"].add(rest[1])
                    elif rest[0].endswith(".py"):
                        found["pyfile"].add(rest[0])
                elif name in TOOLS and w in (name, f".venv/bin/{name}"):
                    sub = []
                    for r in rest:
                        if not re.fullmatch(r"[a-z][a-z-]*", r):
                            break
                        sub.append(r)
                    if sub:
                        found["tool"].add((name, *sub[:3]))
                elif name == "bash" and rest and not rest[0].startswith("-"):
                    found["bash"].add(rest[0])
        for tok in re.findall(r"(?<![\w/~.$<-])((?:\.\./)?[\w.-]+(?:/[\w.-]+)+/?)", text):
            if tok.split("/")[0] in ROOTS and not re.search(r"[<>*{}$]", tok):
                found["path"].add(tok.rstrip("/"))
    for target in re.findall(r"\]\(([^)\s]+)\)", md):
        if not re.match(r"[a-z]+://", target):
            found["link"].add(target.split("#")[0])
    return found


def _run(argv: list[str]) -> tuple[list[str], int, str]:
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    return argv, r.returncode, (r.stderr or r.stdout).strip().splitlines()[-1:] and (r.stderr or r.stdout).strip().splitlines()[-1] or ""


def test_every_path_link_and_script_the_docs_name_exists():
    missing = []
    for doc in documents():
        n = named(doc.read_text())
        for p in n["path"] | n["pyfile"] | n["bash"]:
            if not (ROOT / p).exists():
                missing.append(f"{doc.name}: {p}")
        for link in n["link"]:
            if not (doc.parent / link).exists():
                missing.append(f"{doc.name}: link {link}")
    assert missing == []


def test_every_command_the_docs_name_answers_help():
    from typer.testing import CliRunner

    from flows.cli import app

    subs, modules, pyfiles, tools = set(), set(), set(), set()
    for doc in documents():
        n = named(doc.read_text())
        subs |= n["sub"]
        modules |= n["module"]
        pyfiles |= {p for p in n["pyfile"] if p.split("/")[0] in ("bench", "scripts")}
        tools |= n["tool"]
    assert {"run", "reproduce", "promotions", "lineage"} <= subs and tools  # the scanner reads the docs at all
    runner = CliRunner()
    bad = [f"evoharness {s}" for s in sorted(subs) if runner.invoke(app, [s, "--help"]).exit_code != 0]
    bin_dir = Path(sys.executable).parent
    argvs = [[sys.executable, "-m", m, "--help"] for m in sorted(modules)]
    argvs += [[sys.executable, p, "--help"] for p in sorted(pyfiles)]
    argvs += [[str(bin_dir / t[0]), *t[1:], "--help"] for t in sorted(tools)]
    with ThreadPoolExecutor(2) as ex:
        for argv, rc, last in ex.map(_run, argvs):
            if rc != 0:
                bad.append(f"{' '.join(argv[1:] if argv[0] == sys.executable else [Path(argv[0]).name, *argv[1:]])}: exit {rc} ({last})")
    assert bad == []


def test_the_scanner_finds_what_a_document_names():
    md = ("Run `.venv/bin/evoharness grpo --seed 1` or `python bench/nothing_here.py`; see [x](gone.md).\n"
          "```bash\nbash scripts/missing.sh   # a comment naming evoharness/not/there.py\n.venv/bin/dvc remote add -d s s3://b\n```\n"
          "Outputs like `data/eval/results.json` and `<run id>` are not paths of the repository; `evoharness/agent/reward.py` is.\n")
    n = named(md)
    assert n["sub"] == {"grpo"} and n["pyfile"] == {"bench/nothing_here.py"} and n["bash"] == {"scripts/missing.sh"}
    assert n["tool"] == {("dvc", "remote", "add")} and n["link"] == {"gone.md"}
    assert n["path"] == {"bench/nothing_here.py", "scripts/missing.sh", "evoharness/agent/reward.py"}
