"""megatrain's layering, enforced: every import under ``megatrain/`` follows the table in the section
"Layers and the allowed import order" of docs/architecture.md, and no modules import each other in
a cycle.

The rules have one home, that table: :func:`parse_layers` reads it, so the doc and this test cannot
disagree. Every ``import`` statement counts, also one inside a function (a lazy import is still a
dependency); one under ``if TYPE_CHECKING:`` does not (it never runs). Cycles are looked for over
module-level imports only: an import inside a function runs after both modules have loaded.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
SECTION = "## Layers and the allowed import order"

# TEMPORARY (issue 16): pipeline.py and parallelize.py are being rewritten to take the model family
# from megatrain.models.registry; until then they import the GPT family directly. Entries are
# (importing file, imported module). test_temporary_allowlist_is_still_needed fails once an entry
# matches no import, so the rewrite deletes them (and then this set, empty, may go too).
TEMPORARY_ALLOWLIST: frozenset[tuple[str, str]] = frozenset()


# -- the rules: the layer table of docs/architecture.md ------------------------------------------

@dataclass(frozen=True)
class Layer:
    name: str
    patterns: tuple[str, ...]  # "pkg/file.py", "pkg/folder/" or "pkg/models/*/" (* = one folder)
    may_import: frozenset[str] | None  # None: every layer


def parse_layers(markdown: str, section: str = SECTION) -> list[Layer]:
    """The first table after the heading ``section``: columns layer | modules | may import.

    Names and paths are the cells' backticked words; a "may import" cell saying "every layer"
    allows everything.
    """
    assert section in markdown, f"no section {section!r}"
    rows: list[list[str]] = []
    for line in markdown[markdown.index(section):].splitlines()[1:]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows or line.startswith("#"):
            break
    assert len(rows) > 2, f"{section}: no layer table"
    header, _rule, *body = rows
    assert [h.lower() for h in header] == ["layer", "modules", "may import"], f"{section}: columns {header}"
    layers = []
    for name_cell, modules_cell, imports_cell in body:
        (name,) = re.findall(r"`([^`]+)`", name_cell)
        may = None if "every layer" in imports_cell else frozenset(re.findall(r"`([^`]+)`", imports_cell))
        layers.append(Layer(name, tuple(re.findall(r"`([^`]+)`", modules_cell)), may))
    names = {layer.name for layer in layers}
    assert len(names) == len(layers), f"{section}: a layer is named twice"
    for layer in layers:
        unknown = (layer.may_import or frozenset()) - names
        assert not unknown, f"{section}: layer {layer.name} may import unknown layers {sorted(unknown)}"
    return layers


def _match(pattern: str, path: str) -> str | None:
    """The part of ``path`` that ``pattern`` matches (a folder pattern matches everything under it)."""
    regex = re.escape(pattern).replace(r"\*", "[^/]+")
    m = re.match(f"({regex})" + ("" if pattern.endswith("/") else "$"), path)
    return m.group(1) if m else None


def layer_of(path: str, layers: list[Layer]) -> tuple[Layer, str | None] | None:
    """(layer, unit) of a file path; the most specific pattern wins (``models/common/`` over
    ``models/*/``). ``unit`` is the folder a ``*`` pattern matched (one model family), else None."""
    best = None
    for layer in layers:
        for pattern in layer.patterns:
            matched = _match(pattern, path)
            specificity = len(pattern.replace("*", ""))
            if matched is not None and (best is None or specificity > best[0]):
                best = (specificity, layer, matched if "*" in pattern else None)
    return None if best is None else (best[1], best[2])


# -- the imports ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Import:
    file: str  # the importing file, relative to the root
    line: int
    source: str  # the importing module, dotted
    target: str  # the imported module, dotted
    module_level: bool


def module_name(rel: str) -> str:
    parts = rel.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(name: str, root: Path) -> str:
    """The file of a dotted module name (one that does not exist yet is taken as ``name.py``)."""
    rel = name.replace(".", "/")
    return f"{rel}/__init__.py" if (root / rel).is_dir() else f"{rel}.py"


def _is_module(name: str, root: Path) -> bool:
    rel = name.replace(".", "/")
    return (root / f"{rel}.py").is_file() or (root / rel / "__init__.py").is_file()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(nodes: Iterable[ast.AST], module_level: bool) -> Iterator[tuple[ast.stmt, bool]]:
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, module_level
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.orelse, module_level)
        else:
            inner = module_level and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from _import_nodes(ast.iter_child_nodes(node), inner)


def _targets(node: ast.stmt, source: str, is_package: bool, root: Path) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    module = node.module or ""
    if node.level:  # relative: from the importing module's package, one level up per extra dot
        base = source.split(".") if is_package else source.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        module = ".".join(base + ([module] if module else []))
    targets = []
    for alias in node.names:  # `from pkg import sub` imports the submodule pkg.sub
        sub = f"{module}.{alias.name}"
        target = sub if alias.name != "*" and _is_module(sub, root) else module
        if target not in targets:
            targets.append(target)
    return targets


def collect_imports(root: Path, package: str) -> list[Import]:
    """Every import of a module of ``package`` by a file under ``root/package``."""
    imports = []
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        source = module_name(rel)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
        for node, module_level in _import_nodes(tree.body, True):
            for target in _targets(node, source, path.name == "__init__.py", root):
                if (target == package or target.startswith(package + ".")) and target != source:
                    imports.append(Import(rel, node.lineno, source, target, module_level))
    return imports


# -- the checks -------------------------------------------------------------------------------------

def layer_violations(root: Path, package: str, layers: list[Layer],
                     allowlist: frozenset[tuple[str, str]] = frozenset()) -> tuple[list[str], set]:
    """One message per file no layer covers and per import against the table; and the allowlist
    entries that excused an import."""
    problems: list[str] = []
    used: set[tuple[str, str]] = set()
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if layer_of(rel, layers) is None:
            problems.append(f"{rel}: no row of the layer table covers this file")
    for imp in collect_imports(root, package):
        src, dst = layer_of(imp.file, layers), layer_of(module_path(imp.target, root), layers)
        if src is None:
            continue  # reported above
        if dst is None:
            problems.append(f"{imp.file}:{imp.line}: imports {imp.target}, which no row of the layer table covers")
            continue
        (src_layer, src_unit), (dst_layer, dst_unit) = src, dst
        if src_layer.name == dst_layer.name:
            if src_unit == dst_unit:
                continue
        elif src_layer.may_import is None or dst_layer.name in src_layer.may_import:
            continue
        if (imp.file, imp.target) in allowlist:
            used.add((imp.file, imp.target))
            continue
        if src_layer.name == dst_layer.name:
            why = f"one {src_layer.name} ({src_unit}) may not import another ({dst_unit})"
        else:
            allowed = ", ".join(sorted(src_layer.may_import or ())) or "nothing outside itself"
            why = f"layer {src_layer.name} may import only: {allowed}"
        problems.append(f"{imp.file}:{imp.line}: imports {imp.target} (layer {dst_layer.name}); {why}")
    return problems, used


def import_cycles(root: Path, package: str) -> list[list[str]]:
    """The cycles of module-level imports: one loop of modules per strongly connected group."""
    graph: dict[str, set[str]] = {}
    for imp in collect_imports(root, package):
        graph.setdefault(imp.source, set())
        if imp.module_level and _is_module(imp.target, root):
            graph[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)

    def loop(group: set[str]) -> list[str]:  # a path from the group's first module back to it
        start = min(group)
        paths = {start: [start]}
        frontier = [start]
        while frontier:
            v = frontier.pop(0)
            for w in sorted(graph[v] & group):
                if w == start:
                    return paths[v]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    frontier.append(w)
        raise AssertionError(group)

    return sorted(loop(group) for group in groups)


# -- megatrain --------------------------------------------------------------------------------------

def _layers() -> list[Layer]:
    return parse_layers(ARCHITECTURE.read_text(encoding="utf-8"))


def test_every_import_follows_the_layer_table():
    problems, _ = layer_violations(ROOT, "megatrain", _layers(), TEMPORARY_ALLOWLIST)
    assert not problems, "imports against docs/architecture.md's layer table:\n" + "\n".join(problems)


def test_temporary_allowlist_is_still_needed():
    _, used = layer_violations(ROOT, "megatrain", _layers(), TEMPORARY_ALLOWLIST)
    stale = sorted(TEMPORARY_ALLOWLIST - used)
    assert not stale, f"TEMPORARY_ALLOWLIST entries no import needs any more (delete them): {stale}"


def test_no_import_cycles():
    cycles = import_cycles(ROOT, "megatrain")
    assert not cycles, "module-level import cycles:\n" + "\n".join(" -> ".join(c + c[:1]) for c in cycles)


def test_the_table_names_the_layers_it_promises():
    layers = {layer.name: layer for layer in _layers()}
    assert layers["base"].may_import == frozenset()
    assert layers["top"].may_import is None
    assert "training" not in layers["parallel"].may_import | layers["data"].may_import | layers["checkpoint"].may_import
    assert layer_of("megatrain/models/common/mlp.py", list(layers.values()))[0].name == "models.common"
    assert layer_of("megatrain/models/gpt/model.py", list(layers.values())) == (
        layers["models.family"], "megatrain/models/gpt/")


# -- the checker itself, on a planted package ---------------------------------------------------

PLANTED_DOC = f"""\
# Planted

{SECTION}

| layer | modules | may import |
|---|---|---|
| `low` | `pkg/low/` | nothing |
| `fam` | `pkg/fam/*/` | `low` |
| `high` | `pkg/__init__.py`, `pkg/high/` | `low`, `fam` |

## Next section
"""

PLANTED_FILES = {
    "pkg/__init__.py": "",
    "pkg/low/__init__.py": "",
    "pkg/low/a.py": "from pkg.low import b\n",  # a <-> b: a cycle inside one layer
    "pkg/low/b.py": "import os\nimport pkg.low.a\n",
    "pkg/low/lazy.py": "def f():\n    from pkg.high import top\n",  # a lazy upward import still counts
    "pkg/low/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import top\n",
    "pkg/fam/x/__init__.py": "from pkg.fam.y import m\n",  # one family imports another
    "pkg/fam/x/own.py": "from . import helper\nfrom pkg.fam.x import helper as h\n",
    "pkg/fam/x/helper.py": "from pkg.low import b\n",
    "pkg/fam/y/__init__.py": "",
    "pkg/fam/y/m.py": "",
    "pkg/high/__init__.py": "",
    "pkg/high/top.py": "from ..low import a\nfrom pkg.fam.y import m\ndef g():\n    from pkg.high import other\n",
    "pkg/high/other.py": "from pkg.high import top\n",  # top -> other only inside a function: no cycle
    "pkg/stray.py": "",  # in no row of the table
}


def _plant(tmp_path: Path) -> list[Layer]:
    for rel, text in PLANTED_FILES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    return parse_layers(PLANTED_DOC)


def test_checker_reports_planted_violations_and_cycle(tmp_path):
    layers = _plant(tmp_path)
    problems, used = layer_violations(tmp_path, "pkg", layers)
    assert len(problems) == 3, problems
    assert any(p.startswith("pkg/low/lazy.py:2: imports pkg.high.top (layer high)") for p in problems), problems
    assert any(p.startswith("pkg/fam/x/__init__.py:1: imports pkg.fam.y.m (layer fam)") for p in problems), problems
    assert any(p.startswith("pkg/stray.py:") for p in problems), problems
    assert used == set()
    assert import_cycles(tmp_path, "pkg") == [["pkg.low.a", "pkg.low.b"]]


def test_allowlist_excuses_exactly_its_entries(tmp_path):
    layers = _plant(tmp_path)
    entry = ("pkg/low/lazy.py", "pkg.high.top")
    problems, used = layer_violations(tmp_path, "pkg", layers, frozenset({entry, ("pkg/low/a.py", "pkg.x")}))
    assert len(problems) == 2 and not any("lazy.py" in p for p in problems), problems
    assert used == {entry}
