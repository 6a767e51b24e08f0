"""Every relative link in README.md and docs/ resolves to a file or folder inside the repository (issue 16:
no dead links to files outside the repo). Web links (http, https, mailto) and same-page anchors are not
checked; a link's #anchor is dropped before the file is looked up."""
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# [text](target) and [text](target "title"); images too. Code spans are removed first.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~)")


def markdown_files():
    yield ROOT / "README.md"
    yield from sorted((ROOT / "docs").rglob("*.md"))


def links(path):
    in_fence = False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line.strip()):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        line = re.sub(r"`[^`]*`", "", line)
        for m in LINK.finditer(line):
            yield n, m.group(1)


def dead_links():
    dead = []
    for md in markdown_files():
        for n, target in links(md):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            rel = target.split("#", 1)[0]
            resolved = Path(os.path.normpath(md.parent / rel))
            where = f"{md.relative_to(ROOT)}:{n}: {target}"
            if ROOT != resolved and ROOT not in resolved.parents:
                dead.append(where + " (outside the repository)")
            elif not resolved.exists():
                dead.append(where + " (no such file)")
    return dead


def test_every_relative_link_resolves_inside_the_repository():
    assert dead_links() == []


def test_the_checker_finds_dead_and_outside_links(tmp_path, monkeypatch):
    # The checker itself: a copy of the layout with one dead and one outside link is caught.
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("[ok](docs/a.md) [web](https://example.org) [anchor](#x)\n")
    (tmp_path / "docs" / "a.md").write_text(
        "[dead](missing.md) [out](../../etc/passwd) [fine](../README.md#top) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert dead_links() == ["docs/a.md:1: missing.md (no such file)",
                            "docs/a.md:1: ../../etc/passwd (outside the repository)"]
