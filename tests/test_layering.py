"""The package's wiring, read from its own imports: data flows server -> engine -> model (the sampler beside
the model, under the engine), no module reaches back up (the model, at the bottom, imports only itself and leaf
utilities), and no modules import each other in a circle (lazy imports count too). Inside the engine, its
roles run front -> core -> worker: the step loop never imports the front that talks to it, the worker neither
of them; the data they share (sequence.py, thinking.py, messages.py) imports no role. The server sees the
engine only through the front's client interface."""
import ast
from pathlib import Path

import zhuzi

PACKAGE = Path(zhuzi.__file__).parent
# A module under the key may not import anything under these.
FORBIDDEN = {
    "zhuzi.sample": ("zhuzi.engine", "zhuzi.model", "zhuzi.server", "zhuzi.cli", "zhuzi.bench", "zhuzi.llm"),
    "zhuzi.engine": ("zhuzi.server", "zhuzi.cli", "zhuzi.bench", "zhuzi.llm"),
    "zhuzi.server": ("zhuzi.model", "zhuzi.cli", "zhuzi.bench", "zhuzi.llm"),
    # What every API shares knows none of them: each API turns its body into common's one chat request.
    "zhuzi.server.common": ("zhuzi.server.openai", "zhuzi.server.anthropic", "zhuzi.server.responses",
                            "zhuzi.server.ollama", "zhuzi.server.inspect", "zhuzi.server.pins", "zhuzi.server.app",
                            "zhuzi.server.status", "zhuzi.server.lifecycle"),
    "zhuzi.server.anthropic": ("zhuzi.server.openai",),
}
# Modules that import nothing of the package, so that the model, at the bottom, may use them.
LEAVES = {"zhuzi.disk_cache"}
# What of the engine the server may import: the client interface, and the data a request carries (Probe).
SERVER_SEES = {"zhuzi.engine.front.client", "zhuzi.engine.sequence"}
# The engine's roles, top to bottom: the front (the client the server holds, where it starts and routes to the
# engine cores), the core (the step loop, scheduler, KV pages), the worker (the model runner, tensor-parallel
# ranks). A role imports itself and the roles below it.
ROLES = ("zhuzi.engine.front", "zhuzi.engine.core", "zhuzi.engine.worker")
# Beside the roles, the data they share: a request's and a sequence's (sequence, and the thought budget a sequence
# carries), the wire between front and core (messages).
SHARED = {"zhuzi.engine.sequence", "zhuzi.engine.thinking", "zhuzi.engine.messages"}


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
    assert "zhuzi.engine.worker.model_runner" in GRAPH["zhuzi.engine.core.engine_core"]
    assert "zhuzi.engine.core.output_processor" in GRAPH["zhuzi.engine.core.engine_core"]
    assert "zhuzi.engine.core.engine_core_proc" in GRAPH["zhuzi.engine.front.placement"]
    assert "zhuzi.engine.core.kv.page_manager" in GRAPH["zhuzi.engine.core.scheduler"]  # subpackages too
    assert "zhuzi.engine.messages" in (GRAPH["zhuzi.engine.core.engine_core_proc"]
                                       & GRAPH["zhuzi.engine.front.core_client"])
    assert "zhuzi.sample.sampler" in GRAPH["zhuzi.engine.worker.model_runner"]
    assert "zhuzi.server.common.request" in GRAPH["zhuzi.server.common.chat"]
    assert "zhuzi.server.common.request" in GRAPH["zhuzi.server.openai.protocol"]


def engine_imports(name: str) -> set[str]:
    return {target for target in GRAPH[name] if target.startswith("zhuzi.engine.")}


def test_the_server_sees_the_engine_only_through_its_client():
    seen = {target for name in GRAPH if name.startswith("zhuzi.server.") for target in engine_imports(name)}
    assert seen <= SERVER_SEES, seen - SERVER_SEES
    assert "zhuzi.engine.front.client" in seen


def role(name: str) -> int | None:
    """The depth of the engine role name belongs to (0: the front), None for the shared data."""
    return next((depth for depth, package in enumerate(ROLES) if within(name, package)), None)


def test_every_engine_module_has_a_role_or_is_shared_data():
    engine = [name for name in GRAPH if name.startswith("zhuzi.engine.")]
    assert [name for name in engine if role(name) is None and name not in SHARED] == []
    assert all(any(role(name) == depth for name in engine) for depth in range(len(ROLES)))


def test_the_engine_roles_import_only_downwards():
    """front -> core -> worker: the core never imports the front, the worker neither the core nor the front."""
    assert "zhuzi.engine.worker.model_runner" in engine_imports("zhuzi.engine.core.engine_core")
    up = [f"{name} imports {target}" for name in GRAPH if name.startswith("zhuzi.engine.")
          for target in engine_imports(name) if role(target) is not None
          and (name in SHARED or role(target) < role(name))]
    assert up == []


def test_the_step_loop_never_imports_its_front():
    back = [name for name in GRAPH if name.startswith("zhuzi.engine.") and role(name) != 0]
    assert "zhuzi.engine.core.engine_core_proc" in back and "zhuzi.engine.core.scheduler" in back
    assert [f"{name} imports {target}" for name in back for target in engine_imports(name) if role(target) == 0] == []


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
