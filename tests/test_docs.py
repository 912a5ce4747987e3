"""The documentation holds together: every relative link of README.md and docs/*.md names a file
that exists and, with a #fragment, a heading of that file; the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_BYTES = 12_000

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings (code blocks left out)."""
    text = FENCE.sub("", path.read_text())
    return {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+?)#*$", text, re.M)
    }


def links(path: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", path.read_text()))


def test_the_anchor_rule_matches_github():
    page = REPO / "docs" / "operations.md"
    assert "pacing-on-the-databases-health" in anchors(page)
    assert "deadline-sla-alerts" in anchors(page)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_to_existing_files_and_headings(doc: Path):
    problems = []
    for target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            problems.append(f"{target}: no file {path}")
            continue
        if fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            problems.append(f"{target}: no heading #{fragment} in {dest.relative_to(REPO)}")
    assert problems == [], f"{doc.relative_to(REPO)}: {problems}"


def test_readme_is_short():
    size = (REPO / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, at most {README_MAX_BYTES}"


def test_alert_runbook_links_have_their_sections():
    """The runbook sections that alert messages and the Prometheus rules link to."""
    have = anchors(REPO / "docs" / "runbook.md")
    assert {"runbook", "drift_above_threshold", "no_success_26h", "run_over_budget"} <= have
