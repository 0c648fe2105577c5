"""The docs stay true, short and about the product.

- **Process talk.** README, CHANGELOG, docs and the comments of the code say what the plugin does and why; a reason is
  given as the reason itself, never as a reference to an internal work item, a work session or the machines it ran
  on. Public references (verl #7829, verl PR #7830, TRL #6140, arXiv ids) are fine: they carry a ``#`` or an id, not
  the words this test looks for.
- **Links.** Every relative link of README and docs reaches a file, and a ``#fragment`` a heading of that page.
- **The CLI.** Every option of ``verl-klcov-global diagnose`` (read from the real parser) is described in
  docs/DIAGNOSE.md, not only in ``--help``; ``prepare-model``'s options are in the docs too.
- **The modes.** Every shipped mode has its page (its name in the page's title), and a block of README or docs (a
  paragraph, a list, a table, a code block) that names three or more shipped modes names all of them, or exactly the
  modes the entropy controller applies to (``ModeSpec.entropy_sign != 0``). A block that means a subset names the
  others too and says why they are left out.
- **One home per figure.** A figure that several pages would state (the exchange's bytes per mode; the README's
  set-up and test times) is stated in one section; other pages link to it.
- **Size.** docs/ holds at most 3,000 lines of Markdown.

The README's knob table is checked against the config classes (name, default, valid values) by
``tests/test_knob_table.py``: the README must hold exactly what ``python -m verl_klcov_global.knob_table`` makes.

Each check is a plain function of text, so ``test_each_check_fails_on_a_broken_input`` shows it can fail.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
#: The most lines docs/ may hold (Markdown, every page).
MAX_DOC_LINES = 3000

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

#: figure -> (its home page, the heading of its home section, the figures as written there). Write each elsewhere
#: as a link to the home section.
ONE_HOME = {
    "the exchange's bytes per mode": ("docs/HOW_IT_WORKS.md", "## The exchange, per mode",
                                      ("8,288", "8,384", "8,256", "16,496", "16,448")),
    "the README's set-up and test times": ("README.md", "## Verify it", ("1,450 s", "1,241 tests")),
}


# ---------------------------------------------------------------------------------------------- the pages' text

def _pages() -> list[Path]:
    """README and every Markdown page of docs/."""
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def _name(path: Path) -> str:
    return str(path.relative_to(REPO))


def _blocks(text: str) -> list[str]:
    """The page's blocks: each fenced code block whole, the rest split at blank lines (a paragraph, a list, a table)."""
    blocks, current, fenced = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if fenced:
                blocks.append("\n".join(current + [line]))
                current, fenced = [], False
                continue
            if current:
                blocks.append("\n".join(current))
            current, fenced = [line], True
            continue
        if not fenced and not line.strip():
            if current:
                blocks.append("\n".join(current))
            current = []
            continue
        current.append(line)
    if current:
        blocks.append("\n".join(current))
    return blocks


def _prose(text: str) -> str:
    """The text without its fenced code blocks (links and headings there are not the page's)."""
    return "\n".join(block for block in _blocks(text) if not block.lstrip().startswith("```"))


def _section(text: str, heading: str) -> str:
    """From the line ``heading`` to the next heading of the same or a higher level ('' when there is none)."""
    lines = text.splitlines()
    level = len(heading) - len(heading.lstrip("#"))
    try:
        start = lines.index(heading)
    except ValueError:
        return ""
    end = next((i for i in range(start + 1, len(lines))
                if re.match(rf"#{{1,{level}}} ", lines[i])), len(lines))
    return "\n".join(lines[start:end])


# ---------------------------------------------------------------------------------------------------- the checks

def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (letters, digits, ``_``, ``-`` kept), spaces
    to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link's text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in _prose(text).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(path: Path, text: str, read=lambda target: target.read_text(encoding="utf-8")) -> list[str]:
    """Each relative link of ``text`` (the page at ``path``) whose file is missing or whose ``#fragment`` is no
    heading of its page."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(text)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, fragment = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        try:
            page = read(resolved)
        except (FileNotFoundError, IsADirectoryError):
            if not resolved.exists():
                broken.append(f"{target}: no such file")
            continue
        except UnicodeDecodeError:
            page = ""
        if fragment and resolved.suffix == ".md" and fragment not in anchors(page):
            broken.append(f"{target}: no heading of {resolved.name} has the anchor #{fragment}")
    return broken


def missing_options(options: list[str], text: str) -> list[str]:
    """The options the text never names (``--stare-w`` is not named by ``--stare-w-max``)."""
    return [option for option in options if not re.search(re.escape(option) + r"(?![\w-])", text)]


def partial_mode_lists(text: str, shipped: set[str], controlled: set[str]) -> list[str]:
    """The blocks that name three or more shipped modes, but neither all of them nor exactly the controlled ones."""
    found = []
    for block in _blocks(text):
        named = set(re.findall(r"\b[a-z][a-z0-9_]*_global\b", block)) & shipped
        if len(named) >= 3 and named != shipped and named != controlled:
            found.append(f"names {sorted(named)}, not {sorted(shipped - named)}: {block[:160]!r}")
    return found


def figures_outside_home(pages: dict[str, str], home: str, heading: str, figures: tuple[str, ...]) -> list[str]:
    """Where a figure is stated outside its home section, or is missing from it."""
    def pattern(figure):  # 8,288 or 8288, not inside 18,288 or 8,2880
        return re.compile(r"(?<![\d,.])" + re.escape(figure).replace(",", ",?")
                          + (r"(?![\d,]\d)(?!\d)" if figure[-1].isdigit() else ""))
    problems = []
    home_section = _section(pages.get(home, ""), heading)
    for figure in figures:
        if not pattern(figure).search(home_section):
            problems.append(f"{figure}: not in its home, {home} {heading!r}")
        for name, text in pages.items():
            rest = text.replace(home_section, "") if name == home else text
            for number, line in enumerate(rest.splitlines(), 1):
                if pattern(figure).search(line):
                    problems.append(f"{figure} outside {home} {heading!r}: {name}: {line.strip()[:120]}")
    return problems


# ------------------------------------------------------------------------------------------ what the checks read

def _tracked_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", *ROOTS], cwd=REPO, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"not a git checkout (git ls-files failed: {error})")
    return [REPO / name for name in listed.stdout.decode().split("\0") if name]


def _subcommand(name: str) -> argparse.ArgumentParser:
    from verl_klcov_global.cli import build_parser

    parser = build_parser()
    subparsers = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return subparsers.choices[name]


def _long_options(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(option for action in parser._actions for option in action.option_strings
                  if option.startswith("--") and option != "--help")


def _shipped_modes():
    """The plugin's own modes (a config class of this package), and those the entropy controller applies to."""
    from verl_klcov_global.modes import MODES

    shipped = {name: spec for name, spec in MODES.items()
               if spec.config_class is not None and spec.config_class.__module__.startswith("verl_klcov_global.")}
    return set(shipped), {name for name, spec in shipped.items() if spec.entropy_sign}


# ------------------------------------------------------------------------------------------------------ the tests

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


def test_each_check_fails_on_a_broken_input(tmp_path):
    """The checks below can fail: each is shown a page with the fault it is for, and one without."""
    page = tmp_path / "PAGE.md"
    page.write_text("# Title\n\n## The exchange, per mode\n\ntext\n")
    assert broken_links(page, "[a](PAGE.md#the-exchange-per-mode) [b](#title) [c](https://x.org/y.md#z)") == []
    assert broken_links(page, "[a](MISSING.md)") and broken_links(page, "[a](PAGE.md#no-such-heading)")
    assert broken_links(page, "```\n[a](MISSING.md)\n```") == []  # a code block's text is not a link
    assert slug("KL-Cov where π = π_old: the mask is invariant") == "kl-cov-where-π--π_old-the-mask-is-invariant"
    assert slug("`prepass_layout=old`: the old policy's statistics") == "prepass_layoutold-the-old-policys-statistics"

    assert missing_options(["--stare-w", "--stare-w-max"], "use `--stare-w-max 2`") == ["--stare-w"]

    shipped, controlled = {"a_global", "b_global", "c_global", "d_global"}, {"a_global", "b_global", "c_global"}
    assert partial_mode_lists("`a_global`, `b_global` and `d_global`", shipped, controlled)
    assert partial_mode_lists("`a_global`, `b_global`, `c_global`: the controller's", shipped, controlled) == []
    assert partial_mode_lists("a_global b_global c_global d_global", shipped, controlled) == []
    assert partial_mode_lists("a_global and b_global\n\nc_global", shipped, controlled) == []  # three blocks

    home = "## Home"
    pages = {"H.md": "## Home\n\n8,288 bytes\n\n## Next\n", "O.md": "at most 8288 bytes"}
    assert figures_outside_home(pages, "H.md", home, ("8,288",)) == ["8,288 outside H.md '## Home': O.md: at most 8288 bytes"]
    assert figures_outside_home({"H.md": pages["H.md"]}, "H.md", home, ("8,288",)) == []
    assert figures_outside_home({"H.md": "## Home\n"}, "H.md", home, ("8,288",))  # lost from its home
    assert figures_outside_home({"H.md": pages["H.md"], "O.md": "18,288 and 8,2880, not 8,288."}, "H.md", home,
                                ("8,288",)) == ["8,288 outside H.md '## Home': O.md: 18,288 and 8,2880, not 8,288."]
    assert figures_outside_home({"H.md": "## Home\n\nabout 1,450 s, in all"}, "H.md", home, ("1,450 s",)) == []


def test_every_relative_link_of_readme_and_docs_resolves():
    broken = [f"{_name(path)}: {problem}" for path in _pages()
              for problem in broken_links(path, path.read_text(encoding="utf-8"))]
    assert not broken, "\n".join(broken)


def test_every_diagnose_option_is_described_in_diagnose_md():
    options = _long_options(_subcommand("diagnose"))
    assert len(options) > 30 and "--clip-cov-seed" in options and "--stare-m-min" in options
    missing = missing_options(options, (DOCS / "DIAGNOSE.md").read_text(encoding="utf-8"))
    assert not missing, f"docs/DIAGNOSE.md does not describe: {missing}"


def test_every_prepare_model_option_is_in_the_docs():
    docs = "\n".join(path.read_text(encoding="utf-8") for path in _pages())
    assert "prepare-model" in docs
    assert not missing_options(_long_options(_subcommand("prepare-model")), docs)


def test_every_shipped_mode_has_its_page():
    shipped, _ = _shipped_modes()
    assert len(shipped) >= 5
    titles = {_name(path): path.read_text(encoding="utf-8").splitlines()[0] for path in sorted(DOCS.rglob("*.md"))}
    for mode in sorted(shipped):
        pages = [name for name, title in titles.items() if title.startswith("# ") and f"`{mode}`" in title]
        assert len(pages) == 1, f"{mode}: a page whose title names it, exactly one (found {pages})"


def test_wherever_the_docs_list_the_modes_they_name_every_shipped_mode():
    shipped, controlled = _shipped_modes()
    partial = [f"{_name(path)}: {problem}" for path in _pages()
               for problem in partial_mode_lists(path.read_text(encoding="utf-8"), shipped, controlled)]
    assert not partial, "\n".join(partial)


@pytest.mark.parametrize("figure", sorted(ONE_HOME))
def test_a_figure_several_pages_need_has_one_home(figure):
    home, heading, figures = ONE_HOME[figure]
    pages = {_name(path): path.read_text(encoding="utf-8") for path in _pages()}
    problems = figures_outside_home(pages, home, heading, figures)
    assert not problems, "\n".join(problems)


def test_the_docs_stay_short():
    lines = {_name(path): len(path.read_text(encoding="utf-8").splitlines()) for path in sorted(DOCS.rglob("*.md"))}
    assert sum(lines.values()) <= MAX_DOC_LINES, (sum(lines.values()), lines)
