"""The repository speaks of the product, not of how its work was organised.

README, CHANGELOG, docs and the comments of the code say what the plugin does and why; a reason is given as the
reason itself, never as a reference to an internal work item, a work session or the machines it ran on. Public
references (verl #7829, verl PR #7830, TRL #6140, arXiv ids) are fine: they carry a ``#`` or an id, not the
words this test looks for.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: The tracked files this test reads: these top-level files and every file under these folders.
ROOTS = ("README.md", "CHANGELOG.md", "docs/", "src/", "tests/", "scripts/", "benchmarks/", "experiments/",
         "examples/")

# Each phrase is written in two pieces ("iss" "ue", ...), so that this file does not match its own pattern.
_PHRASES = (
    r"\b(iss" r"ue|iss" r"ues) [0-9]{1,3}\b",
    r"\bst" r"op [0-9]{2}\b",
    r"this ses" r"sion",
    r"another ag" r"ent",
    r"helpers' j" r"obs",
    r"device ti" r"me",
    r"\bwas le" r"nt\b",
    r"\bnot le" r"nt\b",
    r"\blent t" r"o\b",
    r"\bare le" r"nt\b",
    r"as of this cha" r"nge",
    r"-minute bud" r"get",
    r"budget is [0-9]+ min" r"utes",
    r"the issue exp" r"ected",
    r"the next iss" r"ues",
)
#: Words about how the work was organised (the same as ``git grep -niE '<pattern>'`` over the tracked files).
PROCESS_TALK = re.compile("|".join(_PHRASES), re.IGNORECASE)


def _tracked_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", *ROOTS], cwd=REPO, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"not a git checkout (git ls-files failed: {error})")
    return [REPO / name for name in listed.stdout.decode().split("\0") if name]


def test_the_pattern_finds_what_it_is_for():
    """Guards the pieces above: each kind of phrase is still found, and public references are not."""
    for text in ("see iss" "ue 41", "(Iss" "ues 42 and 43)", "St" "op 46 landed", "in this ses" "sion",
                 "no device was le" "nt to this change", "the 90-minute bud" "get"):
        assert PROCESS_TALK.search(text), text
    for text in ("verl issue #7829", "verl PR #7830", "TRL #6140", "arXiv:2506.01939", "verl #6280",
                 "a time budget of 400 s", "the session-scoped fixture"):
        assert not PROCESS_TALK.search(text), text


def test_no_tracked_text_speaks_of_how_the_work_was_organised():
    files = _tracked_files()
    assert any(path.name == "README.md" for path in files)
    hits = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # a binary file (a picture), or one deleted in the working tree
        for number, line in enumerate(text.splitlines(), 1):
            if PROCESS_TALK.search(line):
                hits.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not hits, ("say what the product does and why instead of how the work was organised:\n"
                      + "\n".join(hits))
