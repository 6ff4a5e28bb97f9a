"""The package's layout: docs/how-it-works.md's tree lists every module, and imports run one way (no cycle)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "longreach"


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Who imports whom inside the package: every import statement, at module level or inside a function, and the
    packages that importing a module runs first (``a.b.c`` runs ``a.b``'s ``__init__``), but for the importer's own
    packages, which are being imported already."""
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = ".".join(filter(None, [base if node.level else "", node.module or ""]))
                targets = [
                    f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names
                ]
            else:
                continue
            graph[name] |= {target for target in targets if target in modules and target != name}
        own = {name.rsplit(".", depth)[0] for depth in range(name.count(".") + 1)}
        graph[name] |= {parent for target in set(graph[name]) for parent in _parents(target) if parent not in own}
    return graph


def _parents(name: str) -> list[str]:
    """The packages above a module: ``a.b.c`` -> ``a``, ``a.b``."""
    parts = name.split(".")
    return [".".join(parts[:depth]) for depth in range(1, len(parts))]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:  # noqa: C901 (Tarjan's algorithm, as published)
    """The strongly connected components with more than one member (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_between_modules_or_between_packages():
    """Function-level imports count: a cycle deferred into a function is still a cycle."""
    graph = _imports(_modules())
    assert _cycles(graph) == []
    packages = {}  # longreach.eval.runner -> longreach.eval; top-level modules stand for themselves
    for name, targets in graph.items():
        group = ".".join(name.split(".")[:2])
        packages.setdefault(group, set()).update(".".join(t.split(".")[:2]) for t in targets)
    assert _cycles({group: targets - {group} for group, targets in packages.items()}) == []


def test_the_guide_tree_lists_every_module():
    """docs/how-it-works.md's layout: one line per file, nested as the folders are."""
    text = (ROOT / "docs" / "how-it-works.md").read_text()
    tree = re.search(r"```text\n(longreach/\n.*?)```", text, re.S).group(1).splitlines()
    listed, folders = set(), ["longreach"]
    for line in tree[1:]:
        prefix = re.match(r"[│├└─\s]*", line).group(0)
        depth = len(prefix) // 4
        name = line[len(prefix) :].split()[0]
        folders[depth:] = []
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        else:
            listed.add("/".join([*folders, name]))
    assert listed == {str(path.relative_to(ROOT)) for path in PACKAGE.rglob("*.py")}
