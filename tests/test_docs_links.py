"""Every relative link of the README and of docs/ resolves, and every docs page is reachable.

A link names a file of the repository (relative to the page), optionally with a ``#fragment``
that must be a heading of the page it names, spelled as GitHub spells heading anchors. Links in
code blocks and code spans are text, not links.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    return [target for target in LINK.findall(_prose(text))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation (backticks included) dropped,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def resolve(page: Path, target: str) -> tuple[Path, str]:
    path, _, fragment = target.partition("#")
    return ((page.parent / path).resolve() if path else page), fragment


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page.read_text()):
        path, fragment = resolve(page, target)
        if not path.exists():
            shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            broken.append(f"{target}: no {shown}")
        elif fragment and path.suffix == ".md" and fragment not in anchors(path):
            broken.append(f"{target}: no heading #{fragment} in {path.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_every_docs_page_is_reachable_from_the_readme():
    reached, todo = set(), [README.resolve()]
    while todo:
        page = todo.pop()
        if page in reached or page.suffix != ".md" or not page.exists():
            continue
        reached.add(page)
        todo.extend(resolve(page, target)[0] for target in links(page.read_text()))
    unreached = [p.relative_to(ROOT) for p in PAGES if p.resolve() not in reached]
    assert not unreached, f"no link leads from README.md to {unreached}"


def test_the_readme_stays_a_first_page():
    assert len(README.read_bytes()) <= 15 * 1024


def test_the_link_reader():
    text = ("See [a](docs/a.md#x-y), ![img](pic.png), [web](https://example.com) and "
            "`[not](a link)`.\n```\n[nor](this.md)\n```\n")
    assert links(text) == ["docs/a.md#x-y", "pic.png"]
    assert slug("`kv_transfer_params.kvci`") == "kv_transfer_paramskvci"
    assert slug("Retention across a tool call (`retain`)") == "retention-across-a-tool-call-retain"
    assert slug("A request's life") == "a-requests-life"
