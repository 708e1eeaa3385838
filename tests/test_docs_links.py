"""The docs stand on their own in a clone: every link in the repository's markdown resolves.

A relative link must name a file or folder inside the repository, and a
``#fragment`` into a markdown file must name one of its headings, as GitHub
slugs them. Any other link must be an http(s) URL: nothing may point at a
path outside the clone, which another machine does not have. The markdown is
parsed with markdown-it (CommonMark and tables), so links inside code are
not links, and reference-style links count like inline ones.

The invariants I1-I7 are defined once, in docs/design.md; every other doc
that cites one links to its definition.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token

ROOT = Path(__file__).resolve().parent.parent
_SKIPPED_DIRS = {"node_modules", "build", "dist"}
_HTML_ANCHOR = re.compile(r"""<a\s[^>]*\b(?:name|id)\s*=\s*["']([^"']+)["']""", re.I)


@dataclass(frozen=True, slots=True)
class Link:
    source: Path
    line: int
    target: str

    def __str__(self) -> str:
        return f"{_shown(self.source)}:{self.line}: {self.target}"


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def markdown_files() -> list[Path]:
    """Every markdown file of the repository (not of a virtualenv or a build)."""
    found = []
    for path in sorted(ROOT.rglob("*.md")):
        parts = path.relative_to(ROOT).parts[:-1]
        if any(p.startswith(".") or p.endswith(".egg-info") or p in _SKIPPED_DIRS for p in parts):
            continue
        found.append(path)
    return found


@cache
def _tokens(path: Path) -> list[Token]:
    return MarkdownIt("commonmark").enable("table").parse(path.read_text(encoding="utf-8"))


def _walk(tokens: list[Token], line: int = 0) -> list[tuple[Token, int]]:
    out = []
    for token in tokens:
        here = token.map[0] + 1 if token.map else line
        out.append((token, here))
        if token.children:
            out.extend(_walk(token.children, here))
    return out


def links(path: Path) -> list[Link]:
    """The links and image sources of a markdown file, with the line they start on.

    A code span that starts with ``../`` names a path relative to the file as
    surely as a link does, so it counts as one (``./dev test`` is a command).
    """
    found = []
    for token, line in _walk(_tokens(path)):
        if token.type == "link_open":
            found.append(Link(path, line, str(token.attrGet("href") or "")))
        elif token.type == "image":
            found.append(Link(path, line, str(token.attrGet("src") or "")))
        elif token.type == "code_inline" and token.content.startswith("../"):
            found.append(Link(path, line, token.content.split()[0]))
    return found


def github_slug(text: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to '-'.

    Letters, digits, marks, '_' and '-' stay; everything else (dots, commas,
    parentheses, backticks, dashes other than '-') goes. Hyphens are not merged.
    """
    kept = []
    for char in text.strip().lower():
        category = unicodedata.category(char)
        if char in " -_" or category[0] in "LMN" or category == "Pc":
            kept.append(char)
    return "".join(kept).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """The fragments a link into ``path`` may name: its headings' slugs, and HTML anchors."""
    tokens = _tokens(path)
    seen: dict[str, int] = {}
    found: set[str] = set()
    for index, token in enumerate(tokens):
        if token.type == "heading_open":
            inline = tokens[index + 1]
            text = "".join(
                child.content
                for child in inline.children or []
                if child.type in ("text", "code_inline", "html_inline")
                and not child.content.startswith("<")
            )
            slug = github_slug(text)
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    for token, _ in _walk(tokens):
        if token.type in ("html_block", "html_inline"):
            found.update(_HTML_ANCHOR.findall(token.content))
    return frozenset(found)


def problem(link: Link, root: Path = ROOT) -> str | None:
    """Why ``link`` would be broken in a clone of the repository at ``root``, or None."""
    parts = urlsplit(link.target)
    if parts.scheme in ("http", "https"):
        return None if parts.netloc else "an http(s) URL without a host"
    if parts.scheme or parts.netloc:
        return "points outside the repository (only relative links and http(s) URLs are allowed)"
    if not parts.path:
        target = link.source
    elif parts.path.startswith("/"):
        return "an absolute path: use a path relative to the file"
    else:
        target = (link.source.parent / unquote(parts.path)).resolve()
        if not target.is_relative_to(root):
            return "points outside the repository"
        if not target.exists():
            return f"no such file: {target.relative_to(root)}"
    if parts.fragment and target.suffix == ".md":
        fragment = unquote(parts.fragment)
        if fragment not in anchors(target):
            return f"no heading #{fragment} in {target.relative_to(root)}"
    return None


DESIGN = ROOT / "docs" / "design.md"
_INVARIANT = re.compile(r"\bI([1-7])\b")


def invariant_anchors(design: Path = DESIGN) -> dict[str, str]:
    """``I1`` ... ``I7``: the anchor of each one's definition (a heading) in design.md."""
    found = {}
    for slug in anchors(design):
        match = re.match(r"^i([1-7])-", slug)
        if match:
            found[f"I{match.group(1)}"] = slug
    return found


def uncited_invariants(path: Path, design: Path = DESIGN) -> list[str]:
    """Mentions of an invariant that do not link to its definition in design.md.

    A paragraph, list item or table cell that names I1-I7 must link to the
    definition itself; a heading that names one, somewhere in its section.
    Mentions inside code do not count.
    """
    definitions = invariant_anchors(design)
    tokens = _tokens(path)
    problems: list[str] = []
    pending: list[tuple[int, set[str]]] = []  # a heading's mentions, waiting for its section

    def cited(inline: Token) -> set[str]:
        found = set()
        for child in inline.children or []:
            if child.type != "link_open":
                continue
            parts = urlsplit(str(child.attrGet("href") or ""))
            if parts.scheme or parts.netloc:
                continue
            target = path.parent / unquote(parts.path) if parts.path else path
            if target.resolve() == design.resolve():
                found.add(unquote(parts.fragment))
        return found

    def settle() -> None:
        for line, wanted in pending:
            problems.extend(f"{_shown(path)}:{line}: {name}" for name in sorted(wanted))
        pending.clear()

    for index, token in enumerate(tokens):
        if token.type == "heading_open":
            settle()
        if token.type != "inline":
            continue
        text = "".join(c.content for c in token.children or [] if c.type == "text")
        mentioned = {f"I{n}" for n in _INVARIANT.findall(text)}
        linked = cited(token)
        for _, wanted in pending:
            wanted -= {name for name in wanted if definitions.get(name) in linked}
        pending[:] = [(line, wanted) for line, wanted in pending if wanted]
        line = token.map[0] + 1 if token.map else 0
        missing = {name for name in mentioned if definitions.get(name) not in linked}
        if not missing:
            continue
        if index > 0 and tokens[index - 1].type == "heading_open":
            pending.append((line, missing))
        else:
            problems.extend(f"{_shown(path)}:{line}: {name}" for name in sorted(missing))
    settle()
    return problems


def _broken(paths: list[Path]) -> list[str]:
    return [f"{link}: {why}" for path in paths for link in links(path) if (why := problem(link))]


# --------------------------------------------------------------------------- the checker itself


def test_github_slugs() -> None:
    assert github_slug("Rolling restart (config change, upgrade)") == (
        "rolling-restart-config-change-upgrade"
    )
    assert github_slug("I3 — one slow listener") == "i3--one-slow-listener"
    assert github_slug("Wire protocol (schemas/)") == "wire-protocol-schemas"
    assert github_slug("`GET /changefeeds/stats`") == "get-changefeedsstats"
    assert github_slug("Über_cursor 4000-4011") == "über_cursor-4000-4011"


def test_the_checker_finds_each_kind_of_broken_link(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "deploy").mkdir()
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "DESIGN.md").write_text("# Design\n")
    page = repo / "docs" / "design.md"
    page.write_text("# Design\n\n## Wire contract: websocket\n")
    (repo / "docs" / "operations.md").write_text("# Operations\n")
    cases = {
        "../../shared/DESIGN.md": "points outside the repository",
        "../shared/DESIGN.md": "no such file",
        "no-such-page.md": "no such file",
        "design.md#no-such-heading": "no heading",
        "#no-such-heading": "no heading",
        "/etc/passwd": "an absolute path",
        "file:///etc/passwd": "points outside the repository",
        "mailto:someone@example.com": "points outside the repository",
        "https:/no-host": "without a host",
    }
    for target, expected in cases.items():
        why = problem(Link(page, 1, target), repo)
        assert why is not None and expected in why, (target, why)
    fine = [
        "operations.md",
        "operations.md#operations",
        "../deploy/",
        "https://example.com/x",
        "#wire-contract-websocket",
    ]
    for target in fine:
        assert problem(Link(page, 1, target), repo) is None, target


def test_links_in_code_are_not_links_but_relative_paths_in_code_are(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n`[not](a-link.md)`\n\n```\n[nor](this.md)\n```\n\n"
        "A [reference][ref] and ![an image](pic.png), and `../a/path.md` in code.\n\n"
        "[ref]: ../elsewhere.md#top\n"
    )
    assert [link.target for link in links(page)] == [
        "../elsewhere.md#top",
        "pic.png",
        "../a/path.md",
    ]
    assert anchors(page) == {"title"}


def test_duplicate_headings_get_numbered_anchors(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text('# Notes\n\n## Notes\n\n## Notes\n\n<a name="custom"></a>\n')
    assert anchors(page) == {"notes", "notes-1", "notes-2", "custom"}


def test_invariant_citations_must_link_to_the_definition(tmp_path: Path) -> None:
    design = tmp_path / "design.md"
    design.write_text("# Design\n\n### I1: nothing skipped\n\n### I4: convergence\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"  # 1
        "Cited: [I1](design.md#i1-nothing-skipped).\n\n"  # 3
        "Not cited: I4, and `I1` in code is no mention.\n\n"  # 5
        "## Why I4 holds\n\n"  # 7
        "Because of [I4](design.md#i4-convergence).\n\n"  # 9
        "## Why I1 holds\n\n"  # 11: cited in its section, by the table
        "| a | b |\n| --- | --- |\n| I1 | [I1](design.md#i1-nothing-skipped) |\n\n"  # 13-15
        "## I4 again\n\n"  # 17: not cited in its section
        "Nothing here.\n"
    )
    assert invariant_anchors(design) == {"I1": "i1-nothing-skipped", "I4": "i4-convergence"}
    problems = uncited_invariants(page, design)
    assert [p.split(":", 1)[1] for p in problems] == ["5: I4", "15: I1", "17: I4"]


# --------------------------------------------------------------------------- the repository


def test_the_docs_are_found() -> None:
    names = {str(path.relative_to(ROOT)) for path in markdown_files()}
    assert {"README.md", "docs/design.md", "docs/operations.md", "deploy/README.md"} <= names


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves_in_a_clone(path: Path) -> None:
    assert _broken([path]) == []


def test_design_defines_every_invariant() -> None:
    assert sorted(invariant_anchors()) == [f"I{n}" for n in range(1, 8)]


@pytest.mark.parametrize(
    "path",
    [p for p in markdown_files() if p != DESIGN],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_doc_that_cites_an_invariant_links_to_its_definition(path: Path) -> None:
    assert uncited_invariants(path) == []
