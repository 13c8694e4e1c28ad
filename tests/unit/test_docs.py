"""The Markdown docs hold together: links resolve, anchors name headings, the nav lists every page.

Pure Python (no MkDocs): it reads README.md, benchmarks/README.md and every page under docs/,
follows every relative link and ``#anchor`` the way GitHub renders them, and checks that the
same anchors work on the MkDocs site (mkdocs.yml at the repository root, ``mkdocs build --strict``).
"""
from __future__ import annotations

import functools
import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md", *DOCS.rglob("*.md")])
README_MAX_LINES = 200

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
#: [text](target) and ![alt](target), with an optional "title"; text may hold one level of [brackets]
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (fenced lines come back empty, so numbers stay)."""
    lines, fence = [], None
    for line in text.splitlines():
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            lines.append("")
        elif fence is not None:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                fence = None
            lines.append("")
        else:
            lines.append(line)
    return lines


def heading_text(raw: str) -> str:
    """A heading as rendered text: links become their text, code spans their code, emphasis goes."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", raw)
    parts = []
    for i, piece in enumerate(CODE_SPAN.split(text)):
        # split() yields text, fence, code, text, fence, code ...: keep code as is, strip emphasis elsewhere
        if i % 3 == 0:
            parts.append(re.sub(r"[*]|(?<!\w)_+|_+(?!\w)", "", piece))
        elif i % 3 == 2:
            parts.append(piece.strip())
    return "".join(parts).strip()


def github_slug(text: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped (not - or _), each space a hyphen."""
    text = text.lower()
    text = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LMN")
    return text.replace(" ", "-")


def mkdocs_slug(text: str) -> str:
    """Python-Markdown's default toc slug (what MkDocs uses): ASCII only, runs of space and - as one -."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


@functools.cache
def headings(path: Path) -> tuple[str, ...]:
    """The rendered text of every ATX heading of ``path``, in order."""
    found = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match:
            found.append(heading_text(match.group(2)))
    return tuple(found)


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors GitHub gives ``path``'s headings (a repeated slug gets -1, -2 ...)."""
    seen: dict[str, int] = {}
    result = set()
    for text in headings(path):
        slug = github_slug(text)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(result)


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link and image outside code."""
    found = []
    for number, line in enumerate(prose_lines(path.read_text(encoding="utf-8")), start=1):
        for match in LINK.finditer(CODE_SPAN.sub("", line)):
            found.append((number, match.group(1)))
    return found


def relative_links(path: Path) -> list[tuple[int, str, Path, str]]:
    """(line, target, resolved file, anchor) of every link that stays in the repository."""
    result = []
    for number, target in links(path):
        if SCHEME.match(target) or target.startswith("//"):
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / unquote(file_part)).resolve() if file_part else path
        result.append((number, target, resolved, unquote(anchor)))
    return result


def nav_pages() -> list[str]:
    """The .md paths listed in mkdocs.yml's nav (relative to docs_dir)."""
    lines = (ROOT / "mkdocs.yml").read_text(encoding="utf-8").splitlines()
    start = lines.index("nav:") + 1
    end = next((i for i in range(start, len(lines)) if lines[i][:1] not in ("", " ", "-", "#")), len(lines))
    entry = re.compile(r"^\s*-\s+(?:[^:]+:\s+)?([\w./-]+\.md)\s*$")
    return [match.group(1) for match in map(entry.match, lines[start:end]) if match]


def test_the_pages_are_found():
    names = {rel(page) for page in PAGES}
    assert {"README.md", "benchmarks/README.md", "docs/index.md", "docs/reference/settings.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_resolves(page):
    broken = [f"{rel(page)}:{number}: {target}" for number, target, resolved, _ in relative_links(page)
              if not resolved.exists()]
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_anchor_names_a_heading(page):
    broken = []
    for number, target, resolved, anchor in relative_links(page):
        if anchor and resolved.suffix == ".md" and resolved.exists() and anchor not in anchors(resolved):
            broken.append(f"{rel(page)}:{number}: {target}")
    assert not broken, "anchors that match no heading (GitHub slugs):\n" + "\n".join(broken)


@pytest.mark.parametrize("page", sorted(DOCS.rglob("*.md")), ids=rel)
def test_docs_pages_link_only_inside_docs(page):
    """MkDocs cannot resolve a link that leaves docs_dir: a strict build would fail on it."""
    outside = [f"{rel(page)}:{number}: {target}" for number, target, resolved, _ in relative_links(page)
               if DOCS.resolve() not in resolved.parents]
    assert not outside, "links from docs/ to files outside it:\n" + "\n".join(outside)


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_headings_have_the_same_anchor_on_github_and_on_the_site(page):
    differ = [f"{text!r}: GitHub #{github_slug(text)}, MkDocs #{mkdocs_slug(text)}"
              for text in headings(page) if github_slug(text) != mkdocs_slug(text)]
    assert not differ, f"{rel(page)}: headings whose anchors differ:\n" + "\n".join(differ)
    slugs = [github_slug(text) for text in headings(page)]
    repeated = sorted({slug for slug in slugs if slugs.count(slug) > 1})
    assert not repeated, f"{rel(page)}: repeated headings (their anchors differ between GitHub and MkDocs): {repeated}"


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_the_nav_lists_every_docs_page_once():
    listed = nav_pages()
    pages = sorted(page.relative_to(DOCS).as_posix() for page in DOCS.rglob("*.md"))
    assert sorted(set(listed)) == sorted(listed), "a page is listed twice in mkdocs.yml's nav"
    assert sorted(listed) == pages, (f"not in mkdocs.yml's nav: {sorted(set(pages) - set(listed))}; "
                                     f"in the nav but missing: {sorted(set(listed) - set(pages))}")


def test_the_settings_table_lives_in_the_settings_reference():
    """``python -m sparkdl._internal.settings_page`` rewrites the block between these markers (sparkdl/_internal/settings_page.py)."""
    start, end = "<!-- settings:start -->", "<!-- settings:end -->"
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        if page == DOCS / "reference" / "settings.md":
            assert text.count(start) == 1 and text.count(end) == 1
        else:
            assert start not in text, f"{rel(page)} holds a second settings block"


# ----------------------------------------------------------------- the checker itself
@pytest.mark.parametrize("heading, slug", [
    ("Two commands", "two-commands"),
    ("DataFrame API (pyspark.ml)", "dataframe-api-pysparkml"),
    ("`TrainConfig`", "trainconfig"),
    ("Side by side — `python benchmarks/compare.py`", "side-by-side--python-benchmarkscomparepy"),
    ("`ps_hosts` and **shards**", "ps_hosts-and-shards"),
    ("[Spark Connect](spark-connect.md) limits", "spark-connect-limits"),
])
def test_github_slugs(heading, slug):
    assert github_slug(heading_text(heading)) == slug


def test_mkdocs_slugs_collapse_what_github_keeps():
    text = heading_text("Side by side — `python benchmarks/compare.py`")
    assert mkdocs_slug(text) == "side-by-side-python-benchmarkscomparepy" != github_slug(text)


def test_links_in_code_are_not_links(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\nSee [a](a.md#x) and `[b](b.md)`.\n\n```\n[c](c.md)\n# not a heading\n```\n"
                    "![img](pic.png \"caption\") [web](https://example.org) [self](#title)\n", encoding="utf-8")
    assert [target for _, target in links(page)] == ["a.md#x", "pic.png", "https://example.org", "#title"]
    assert headings(page) == ("Title",)
