"""The package's import graph reads top to bottom: no module imports a layer above its own, and no circle.

Parsed from the source (every ``import`` statement, at module level or inside a function), so it
needs no import of the package. The layers, bottom first, are those of ``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "verl_klcov_global"
#: A method's authors' per-loss-call rule (``methods/<name>/authors.py``), a lab comparator: on the harness's layer.
AUTHORS = "methods.*.authors"
SOURCE = Path(__file__).resolve().parents[1] / "src" / PACKAGE

#: Bottom first; a module may import modules of its own layer or of layers below it.
LAYERS = [
    ["selection", "seams", "layout", "install_hint", "configs", "quiet_start", "entropy_control", "knob_doc",
     "per_call"],
    ["mode_config"],
    ["loss"],
    ["modes"],
    ["methods"],  # one folder per method: config, selection, objective, schedule, its row (its authors' rule apart)
    ["config"],  # what users' ``_target_`` lines name: re-exports the methods' classes
    ["guardrails", "knob_table"],
    ["driver", "engine.logprobs", "engine.control", "engine.proxy", "engine.weights", "engine.kept_pass", "engine.reuse", "engine.old_policy", "engine.batch_entropy",
     "engine.schedule", "engine.step_count"],
    ["engine.prepass"],
    ["engine.step"],
    ["engine.patches", "engine"],
    ["plugin"],
    [""],  # the package itself (verl_klcov_global/__init__.py)
    ["worker_loader", "lab", AUTHORS],  # the harness: CPU platform, tiny models, the #7829 experiment, comparators
    ["diagnose"],  # the command, on the harness (before 0.8.0 it lived in lab/ with the harness)
    ["cli", "__main__"],
]
#: Known upward edges, each with its reason.
ALLOWED_UPWARD = {
    # the version string the driver writes into the Ray runtime env; read lazily, at call time
    ("driver", ""),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(path): path for path in SOURCE.rglob("*.py")}


def _is_authors_rule(module: str) -> bool:
    parts = module.split(".")
    return len(parts) == 3 and parts[0] == "methods" and parts[2] == "authors"


def _layer(module: str) -> int:
    if _is_authors_rule(module):
        return next(rank for rank, prefixes in enumerate(LAYERS) if AUTHORS in prefixes)
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (prefix and module.startswith(prefix + ".")) and (
                    best is None or len(prefix) > best[1]):
                best = (rank, len(prefix))
    assert best is not None, f"module {module!r} has no layer in LAYERS: add it"
    return best[0]


def _resolve(module: str, node: ast.AST) -> list[str]:
    """The package modules an import statement in ``module`` names ("" = the package itself)."""
    is_package = MODULES[module].name == "__init__.py"
    targets = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".") if module else []
            base = base if is_package else base[:-1]
            base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
            prefix = ".".join(base + ([node.module] if node.module else []))
            base_name = f"{PACKAGE}.{prefix}".rstrip(".")
        else:
            base_name = node.module
        # ``from X import a``: the submodule X.a when there is one, else X itself
        submodules = [f"{base_name}.{alias.name}" for alias in node.names]
        names = [sub if sub[len(PACKAGE) + 1:] in MODULES else base_name for sub in submodules]
    for name in names:
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            relative = name[len(PACKAGE) + 1:]
            if relative in MODULES:
                targets.append(relative)
    return targets


def _edges() -> set[tuple[str, str, bool]]:
    """(importer, imported, at module level) for every import of a package module by a package module."""
    edges = set()
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _resolve(module, node):
                    if target != module:
                        edges.add((module, target, id(node) in top_level))
    return edges


def test_every_module_has_a_layer_and_imports_none_above_it():
    upward = [(a, b) for a, b, _ in _edges() if _layer(b) > _layer(a) and (a, b) not in ALLOWED_UPWARD]
    assert upward == [], f"imports from a lower layer back up: {sorted(upward)}"


def test_the_module_level_import_graph_has_no_circle():
    graph: dict[str, set[str]] = {}
    for a, b, top in _edges():
        if top:
            graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError(f"import circle: {' -> '.join(path + [nxt])}")
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def _circles(edges) -> list[list[str]]:
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    found, state = [], {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_the_harness_and_the_command_have_no_circle_even_through_function_level_imports():
    """lab/ and diagnose/ (0.7.0: lab/diagnose.py <-> lab/user_losses.py, through imports inside functions)."""
    rooms = ("lab", "diagnose")
    edges = {(a, b) for a, b, _ in _edges()
             if any(a == r or a.startswith(r + ".") for r in rooms) and any(b == r or b.startswith(r + ".") for r in rooms)}
    assert _circles(edges) == []
    assert not [(a, b) for a, b in edges if a.startswith("lab") and b.startswith("diagnose")], "harness -> command"
    assert ("diagnose.run", "lab.experiment") in edges  # not vacuous


def test_the_parser_sees_the_imports_it_must():
    """The checks above would pass vacuously on a parser that finds nothing: pin a few known edges."""
    edges = {(a, b) for a, b, _ in _edges()}
    assert {("methods.kl_cov.row", "modes"), ("config", "methods.stare.config"), ("engine.step", "modes"), ("plugin", "engine.patches"),
            ("engine.prepass", "engine.logprobs"), ("", "plugin"), ("lab.experiment", "engine.step")} <= edges


def test_a_methods_folder_keeps_its_layers():
    """Inside ``methods/<name>/``: the selection imports only the shared selection core (and torch); nothing of the
    trainer's side imports a method's authors' rule (the lab loads it by the name its row gives, in-process)."""
    edges = {(a, b) for a, b, _ in _edges()}
    selections = [m for m in MODULES if m.startswith("methods.") and m.endswith(".selection")]
    assert len(selections) >= 5
    outside_core = [(a, b) for a, b in edges if a in selections and not (b == "selection" or b.startswith("selection."))]
    assert outside_core == [], f"a method's selection imports beyond the shared core: {outside_core}"
    into_authors = [(a, b) for a, b in edges if _is_authors_rule(b) and not a.startswith(("lab", "diagnose"))]
    assert into_authors == [], f"an authors' rule imported outside the lab: {into_authors}"
    assert any(_is_authors_rule(m) for m in MODULES)  # not vacuous
