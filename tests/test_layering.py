"""The package's wiring, read from its own imports: data flows server -> engine -> runner -> model,
no module reaches back up, and no modules import each other in a circle (lazy imports count too)."""
import ast
from pathlib import Path

import zhuzi

PACKAGE = Path(zhuzi.__file__).parent
# A module under the key may not import anything under these.
FORBIDDEN = {
    "zhuzi.model": ("zhuzi.engine", "zhuzi.server", "zhuzi.cli", "zhuzi.bench", "zhuzi.llm"),
    "zhuzi.engine": ("zhuzi.server", "zhuzi.cli", "zhuzi.bench", "zhuzi.llm"),
    "zhuzi.server": ("zhuzi.cli", "zhuzi.bench", "zhuzi.llm"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported(path: Path) -> set[str]:
    """The package's modules that path imports anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module_name(path).split(".")
                package = package[:len(package) - node.level + (path.name == "__init__.py")]
                base = ".".join(package + ([base] if base else []))
            # `from zhuzi.server import protocol` imports the module zhuzi.server.protocol
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
    return {name for name in found if name in MODULES}


GRAPH = {name: imported(path) - {name} for name, path in MODULES.items()}


def test_the_graph_is_read():
    assert "zhuzi.engine.model_runner" in GRAPH["zhuzi.engine.engine"]
    assert "zhuzi.server.protocol" in GRAPH["zhuzi.server.serving"]


def test_lower_layers_never_import_higher_ones():
    breaches = [f"{name} imports {target}" for name, targets in GRAPH.items() for target in targets
                for layer, above in FORBIDDEN.items()
                if (name == layer or name.startswith(layer + ".")) and target.startswith(above)]
    assert breaches == []


def test_no_import_cycles():
    state: dict[str, str] = {}  # "open" while on the DFS stack, "done" after
    cycles = []

    def visit(name: str, stack: list[str]) -> None:
        state[name] = "open"
        for target in sorted(GRAPH[name]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target, stack + [target])
        state[name] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert cycles == []
