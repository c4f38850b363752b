"""The documentation's own rules: the README opens with the two commands CI relies on and stays
short, every relative link of the README and docs/*.md resolves, and the code, tests and docs
describe features, not the work log that produced them (issue numbers, dated stops, "the run
before")."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

# Issue-number framing ("Issue 15", "issue-27 table", "issue #3") and work-log phrasing.
FRAMING = re.compile(r"\b[Ii]ssues?[ -]?#?\d+")
WORK_LOG = re.compile(r"afternoon stop|morning stop|the run before|this session", re.I)

COMMANDS = ['./setup.sh && .venv/bin/cedlm serve', '.venv/bin/python -m pytest -m "not slow"']


def tracked(*patterns: str) -> list[str]:
    """Tracked files matching git pathspecs (the working tree's version is read)."""
    out = subprocess.run(["git", "ls-files", "-z", "--", *patterns], cwd=ROOT, capture_output=True,
                         check=True).stdout.decode()
    return sorted(p for p in out.split("\0") if p)


TEXT = {".py", ".md", ".txt", ".json", ".toml", ".yaml", ".yml", ".cfg", ".h", ".c", ".cpp", ".html",
        ".js", ".css", ".sh", ".jinja"}


def text_files() -> list[str]:
    """The tracked text of cedlm/, tests/ (but the corpus fixtures, which are books), docs/,
    bench/, experiments/ and the top-level *.md files."""
    top = ("cedlm", "tests", "docs", "bench", "experiments")
    files = tracked(*top, "*.md")
    return [f for f in files if Path(f).suffix in TEXT and not f.startswith("tests/fixtures/")
            and ("/" not in f or f.split("/")[0] in top)]


def test_no_issue_numbers_or_work_log_phrases():
    bad = []
    for rel in text_files():
        if rel == THIS:
            continue
        path = ROOT / rel
        if not path.is_file():                    # deleted in the working tree
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            for m in (*FRAMING.finditer(line), *WORK_LOG.finditer(line)):
                bad.append(f"{rel}:{n}: {m.group(0)!r} in {line.strip()[:120]!r}")
    assert not bad, "describe the feature, not the issue or the session:\n" + "\n".join(bad)


def test_the_patterns_catch_what_they_should():
    for s in ("Issue 15, server side", "(issue 30 item 8)", "the issue-27 table", "issue #3", "issue26"):
        assert FRAMING.search(s), s
    for s in ("What the afternoon stop changed", "the morning stop", "The run before it", "this session"):
        assert WORK_LOG.search(s), s
    for s in ("an issue with the cache", "tissue 3", "2 issues"):
        assert not FRAMING.search(s), s


def test_readme_opens_with_the_two_commands_and_stays_short():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 300
    first = re.search(r"```(\w*)\n(.*?)```", readme, flags=re.S)
    assert first and first.group(1) == "bash", "the README's first code block is a bash block"
    assert first.group(2).strip().splitlines() == COMMANDS


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def links(md: Path) -> list[str]:
    """Relative link and image targets of a markdown file, outside code blocks and spans."""
    text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    out = []
    for m in LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue                              # http(s), mailto:, in-page anchors
        out.append(target.split("#", 1)[0])
    return out


def anchors(md: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)
    out = set()
    for h in re.findall(r"(?m)^#{1,6} +(.+?) *#*$", text):
        slug = re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("md", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(md):
    missing = [t for t in links(md) if not (md.parent / t).exists()]
    assert not missing, f"{md.relative_to(ROOT)}: links to missing files: {missing}"


@pytest.mark.parametrize("md", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_in_page_anchors_resolve(md):
    text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)
    wanted = re.findall(r"\]\(#([^)\s]+)\)", text)
    missing = sorted(set(wanted) - anchors(md))
    assert not missing, f"{md.relative_to(ROOT)}: anchors without a heading: {missing}"


def test_every_doc_is_reachable_from_the_readme():
    """Every docs/*.md page is linked from the README (directly or through another page)."""
    seen, todo = set(), [ROOT / "README.md"]
    while todo:
        md = todo.pop()
        if md in seen or md.suffix != ".md" or not md.exists():
            continue
        seen.add(md)
        todo += [(md.parent / t).resolve() for t in links(md)]
    unreachable = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "docs").glob("*.md"))
                   if p.resolve() not in seen]
    assert not unreachable, f"not linked from README.md: {unreachable}"
