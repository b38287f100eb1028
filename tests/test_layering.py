"""The package's wiring, read from its own imports: data flows server -> engine -> runner -> model (the
sampler beside the model, under the engine), no module reaches back up (the model, at the bottom, imports only
itself and leaf utilities), and no modules import each other in a circle (lazy imports count too). The server
sees the engine only through its client interface; the step loop never imports the front that talks to it
(core_client.py and what it starts the engine cores with)."""
import ast
from pathlib import Path

import zhuzi

PACKAGE = Path(zhuzi.__file__).parent
# A module under the key may not import anything under these.
FORBIDDEN = {
    "zhuzi.sample": ("zhuzi.engine", "zhuzi.model", "zhuzi.server", "zhuzi.cli", "zhuzi.bench", "zhuzi.llm"),
    "zhuzi.engine": ("zhuzi.server", "zhuzi.cli", "zhuzi.bench", "zhuzi.llm"),
    "zhuzi.server": ("zhuzi.model", "zhuzi.cli", "zhuzi.bench", "zhuzi.llm"),
}
# Modules that import nothing of the package, so that the model, at the bottom, may use them.
LEAVES = {"zhuzi.disk_cache"}
# What of the engine the server may import: the client interface, and the data a request carries (Probe).
SERVER_SEES = {"zhuzi.engine.client", "zhuzi.engine.sequence"}
# The front of the engine: the client the server holds, and where it starts and routes to the engine cores.
FRONT = {"zhuzi.engine.client", "zhuzi.engine.core_client", "zhuzi.engine.placement", "zhuzi.engine.router"}


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


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
    assert "zhuzi.engine.output_processor" in GRAPH["zhuzi.engine.engine"]
    assert "zhuzi.engine.core" in GRAPH["zhuzi.engine.placement"]
    assert "zhuzi.engine.kv.block_manager" in GRAPH["zhuzi.engine.scheduler"]  # subpackages too
    assert "zhuzi.engine.messages" in GRAPH["zhuzi.engine.core"] & GRAPH["zhuzi.engine.core_client"]
    assert "zhuzi.sample.sampler" in GRAPH["zhuzi.engine.model_runner"]
    assert "zhuzi.server.openai.protocol" in GRAPH["zhuzi.server.common.serving"]


def engine_imports(name: str) -> set[str]:
    return {target for target in GRAPH[name] if target.startswith("zhuzi.engine.")}


def test_the_server_sees_the_engine_only_through_its_client():
    seen = {target for name in GRAPH if name.startswith("zhuzi.server.") for target in engine_imports(name)}
    assert seen <= SERVER_SEES, seen - SERVER_SEES
    assert "zhuzi.engine.client" in seen


def test_the_step_loop_never_imports_its_front():
    back = [name for name in GRAPH if name.startswith("zhuzi.engine.") and name not in FRONT]
    assert "zhuzi.engine.core" in back and "zhuzi.engine.scheduler" in back
    assert [f"{name} imports {target}" for name in back for target in engine_imports(name) & FRONT] == []


def test_lower_layers_never_import_higher_ones():
    breaches = [f"{name} imports {target}" for name, targets in GRAPH.items() for target in targets
                for layer, above in FORBIDDEN.items()
                if within(name, layer) and target.startswith(above)]
    assert breaches == []


def test_the_model_imports_only_itself_and_leaf_utilities():
    outside = [f"{name} imports {target}" for name, targets in GRAPH.items() if within(name, "zhuzi.model")
               for target in targets if not within(target, "zhuzi.model") and target not in LEAVES]
    assert outside == []
    assert {leaf: GRAPH[leaf] for leaf in LEAVES} == {leaf: set() for leaf in LEAVES}


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
