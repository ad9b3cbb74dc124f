"""Print the package's import graph between folders: the imports that run up
the layers and the cycles between folders (docs/architecture.md, "Layers").

    python -P scripts/import_graph.py            # the summary
    python -P scripts/import_graph.py --edges    # every folder-to-folder edge, with its imports

Every import counts: at module level, deferred inside a function, or under
TYPE_CHECKING (a type-only import still couples the folders). tests/ and
scripts/ are outside the package's layers. tests/test_layers.py fails on any
upward import or cycle that this prints.
"""
from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
OUTSIDE_THE_LAYERS = ("tests", "scripts")

# Lowest first: a folder may import its own modules and those of the folders
# before it, never one after it. A subfolder not named here belongs to the
# nearest folder above it that is (workers/models is workers).
LAYERS = ("config", "kernels", "parallel", "core", "workers", "core/launch", "frontend")


def layer_of(folder: str) -> str:
    """The layer a folder belongs to: itself if named, else its nearest named parent."""
    parts = folder.split("/")
    for end in range(len(parts), 0, -1):
        candidate = "/".join(parts[:end])
        if candidate in LAYERS:
            return candidate
    return folder  # the package root (fleet/__init__.py): above every layer


def module_files(root: Path = PACKAGE_ROOT) -> dict[str, Path]:
    """Dotted module name (without the `fleet.` prefix) -> file, for the package outside tests/scripts."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative.parts[0] in OUTSIDE_THE_LAYERS or any(part.startswith(".") for part in relative.parts):
            continue
        if relative.parts[0].endswith(".egg-info") or "__pycache__" in relative.parts:
            continue
        parts = list(relative.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that the file imports (a `from fleet.x import y` of a module y counts as x.y)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from fleet.core import ipc` imports the module core.ipc; `from fleet.core.ipc import x` core.ipc
            submodules = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [name for name in submodules if name.removeprefix("fleet.") in modules]
            if len(names) < len(submodules):
                names.append(node.module)
        else:
            continue
        for name in names:
            if name == "fleet" or not name.startswith("fleet."):
                continue
            dotted = name.removeprefix("fleet.")
            while dotted and dotted not in modules:
                dotted = dotted.rpartition(".")[0]
            if dotted:
                found.add(dotted)
    return found


def folder_of(path: Path, root: Path) -> str:
    return "/".join(path.relative_to(root).parts[:-1])


def folder_edges(root: Path = PACKAGE_ROOT) -> dict[tuple[str, str], list[str]]:
    """(importing folder, imported folder) -> the "a.b -> c.d" imports behind that edge, between different folders."""
    modules = module_files(root)
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, path in modules.items():
        source = folder_of(path, root)
        for target in sorted(imported_modules(path, modules)):
            destination = folder_of(modules[target], root)
            if destination != source:
                edges[source, destination].append(f"{module} -> {target}")
    return dict(edges)


def upward_imports(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    """Imports of a higher layer by a lower one."""
    rank = {layer: index for index, layer in enumerate(LAYERS)}
    upward = []
    for (source, destination), imports in sorted(edges.items()):
        low, high = layer_of(source), layer_of(destination)
        if low in rank and high in rank and rank[high] > rank[low]:
            upward += [f"{layer_of(source)} -> {layer_of(destination)}: {line}" for line in imports]
    return upward


def folder_cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one layer's folder (Tarjan's algorithm); a
    subfolder counts as the layer it belongs to (workers/models importing workers is no cycle)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for source, destination in edges:
        if layer_of(source) != layer_of(destination):
            graph[layer_of(source)].add(layer_of(destination))
            graph.setdefault(layer_of(destination), set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(folder: str) -> None:
        index[folder] = low[folder] = len(index)
        stack.append(folder)
        for other in sorted(graph[folder]):
            if other not in index:
                visit(other)
                low[folder] = min(low[folder], low[other])
            elif other in stack:
                low[folder] = min(low[folder], index[other])
        if low[folder] == index[folder]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == folder:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for folder in sorted(graph):
        if folder not in index:
            visit(folder)
    return cycles


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--edges", action="store_true", help="print every folder-to-folder edge and its imports")
    args = parser.parse_args()
    edges = folder_edges()
    print("layers, lowest first:", " < ".join(LAYERS))
    if args.edges:
        for (source, destination), imports in sorted(edges.items()):
            print(f"{source} -> {destination} ({len(imports)})")
            for line in imports:
                print("   ", line)
    upward = upward_imports(edges)
    cycles = folder_cycles(edges)
    print(f"upward imports: {len(upward)}")
    for line in upward:
        print("   ", line)
    print(f"cycles between folders: {len(cycles)}")
    for cycle in cycles:
        print("   ", " <-> ".join(cycle))
    return 1 if upward or cycles else 0


if __name__ == "__main__":
    sys.exit(main())
