"""README and docs/ hold together: every relative link and image in them points at a file that exists, and every
``#fragment`` at a heading of that file (GitHub's anchors); README stays a page a newcomer reads to the end."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# [text](target) and ![alt](target), the target up to a space or ")"; code spans and fenced blocks are not links.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^ *```.*?^ *```", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (word characters, spaces and hyphens
    kept), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link in a heading anchors on its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in _FENCE.sub("", page.read_text()).splitlines():
        if m := re.match(r"#{1,6} +(.+?) *#*$", line):
            base = slug(m[1])
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers repeated headings
    return found


def links(page: Path) -> list[str]:
    text = _CODE.sub("", _FENCE.sub("", page.read_text()))
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # not http:, mailto:


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in links(page):
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif fragment and (file.suffix != ".md" or fragment not in anchors(file)):
            broken.append(f"{target}: no heading #{fragment} in {path or page.name}")
    return broken


def test_there_are_pages_and_links():
    assert len(PAGES) >= 7, PAGES  # README and at least six pages
    assert sum(len(links(p)) for p in PAGES) > 50


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert not broken_links(page), broken_links(page)


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## The part\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md) [ok](docs/a.md#the-part) [ok](#top) ![img](docs/missing.png) [bad](docs/b.md) "
        "[bad](docs/a.md#no-part) `[code](not/a/link.md)` [web](https://example.com)\n\n# Top\n"
    )
    assert broken_links(page) == [
        "docs/missing.png: no such file",
        "docs/b.md: no such file",
        "docs/a.md#no-part: no heading #no-part in docs/a.md",
    ]


def test_slugs_are_githubs():
    assert slug("Who is slow, and who waits") == "who-is-slow-and-who-waits"
    assert slug("The record's size") == "the-records-size"
    assert slug("GPUs, torchrun, Slurm, several nodes") == "gpus-torchrun-slurm-several-nodes"
    assert slug("`lit_ddp.report --trace`") == "lit_ddpreport---trace"


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
