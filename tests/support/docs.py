"""Code blocks of the docs, for the tests that run a page's worked example as written."""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def section(page: str, heading: str) -> str:
    """The text of ``docs/<page>`` from the line ``heading`` to the next heading of the same level."""
    text = (REPO_ROOT / "docs" / page).read_text()
    level = heading.split(" ", 1)[0]
    start = text.index(heading + "\n")
    following = re.search(rf"^{re.escape(level)} ", text[start + len(heading):], re.M)
    return text[start:start + len(heading) + following.start()] if following else text[start:]


def code_blocks(text: str, language: str) -> list[str]:
    """Every fenced block of ``language`` in ``text``, as written (its trailing newline included)."""
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.M | re.S)
