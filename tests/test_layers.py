"""The packages import one way only: each package imports only packages on lower layers (the
README's architecture section lists the same order), so there is no import cycle between them.
Walks every import statement of `elastic/` and `templates/` with `ast`, including imports
inside functions and under `if TYPE_CHECKING:`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LAYERS: dict[str, int] = {
    "templates": 0,  # the planner: pure, imports nothing of the project
    "comm": 0,  # communicators, the recording group and the NCCL model: torch only
    "model": 1,
    "data": 1,
    "coordinator": 1,
    "transfer": 1,
    "parallel": 2,
    "planning": 2,
    "sim": 3,
    "records": 3,
    "engine": 4,
    "ops": 4,
    "roles": 5,
    "cli": 6,
}
"""Each package's layer; a package may import packages of strictly lower layers only."""


def _package_of(path: Path) -> str | None:
    rel = path.relative_to(ROOT).parts
    if rel[0] == "templates":
        return "templates"
    return rel[1] if len(rel) > 2 else None  # elastic/<package>/<module>.py; None for elastic/*.py


def _imported_packages(path: Path) -> set[str]:
    """Project packages that `path` imports (absolute and relative imports)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module_parts = path.relative_to(ROOT).with_suffix("").parts
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module_parts[: len(module_parts) - node.level]
                names.append(".".join([*base, *([node.module] if node.module else [])]))
            elif node.module:
                names.append(node.module)
    out: set[str] = set()
    for name in names:
        parts = name.split(".")
        if parts[0] == "templates":
            out.add("templates")
        elif parts[0] == "elastic" and len(parts) > 1 and parts[1] in LAYERS:
            out.add(parts[1])
    return out


def _graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> the files that import it."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted([*(ROOT / "elastic").rglob("*.py"), *(ROOT / "templates").rglob("*.py")]):
        src = _package_of(path)
        if src is None:
            continue
        for dst in _imported_packages(path) - {src}:
            graph.setdefault(src, {}).setdefault(dst, []).append(str(path.relative_to(ROOT)))
    return graph


def test_every_package_has_a_layer() -> None:
    packages = {p.name for p in (ROOT / "elastic").iterdir() if p.is_dir() and any(p.glob("*.py"))}
    assert packages | {"templates"} == set(LAYERS)


def test_packages_import_only_lower_layers() -> None:
    upward = [
        f"{src} (layer {LAYERS[src]}) imports {dst} (layer {LAYERS[dst]}) in {files}"
        for src, deps in _graph().items()
        for dst, files in deps.items()
        if LAYERS[dst] >= LAYERS[src]
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycle_between_packages() -> None:
    """Independent of the layer numbers: a depth-first search over the package graph finds no cycle."""
    graph = {src: set(deps) for src, deps in _graph().items()}
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join([*stack, node, nxt])}"
            if nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = 2

    for package in sorted(graph):
        if package not in state:
            visit(package, [])


def test_the_walk_sees_imports() -> None:
    """The walk finds the imports it must: relative, inside functions and under TYPE_CHECKING."""
    graph = _graph()
    assert "engine" in graph["roles"] and "records" in graph["engine"] and "model" in graph["parallel"]


def _loaded_after(modules: list[str], probe: str) -> bool:
    """Whether importing `modules` in a fresh interpreter loads module `probe`."""
    import subprocess
    import sys

    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint({probe!r} in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip() == "True"


def test_records_the_control_plane_and_the_operator_cli_do_not_import_torch() -> None:
    """The records, the agent and its leader, and `elastic status` / `events` stay light: importing
    torch costs every agent about a second of CPU at every node start (all nodes start at once, on
    the cores their workers need)."""
    modules = ["elastic.records.config", "elastic.records.generation", "elastic.records.sync", "elastic.records.progress", "elastic.records.workers", "elastic.records.recovery_timings", "elastic.roles.launcher_feed", "elastic.ops.status_read",
               "elastic.ops.status_table", "elastic.ops.events", "elastic.roles.agent", "elastic.roles.leader"]
    assert not _loaded_after(modules, "torch")


def test_a_worker_starts_without_torch_distributed_checkpoint() -> None:
    """Importing a worker's modules does not import torch.distributed.checkpoint (DTensor, sympy:
    ~0.5 s of CPU): the checkpoint writer's thread does, while the worker registers."""
    assert not _loaded_after(["elastic.roles.elastic_worker", "elastic.engine.checkpoint.writers",
                              "elastic.engine.checkpoint.load"],
                             "torch.distributed.checkpoint")
    assert _loaded_after(["elastic.roles.elastic_worker"], "torch")  # the probe sees what is loaded


def _module_edges(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, read from its import statements."""
    edges: dict[str, set[str]] = {}
    for path in sorted((ROOT / "elastic" / package).glob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text(), filename=str(path))
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module if not node.level else f"elastic.{package}.{node.module}"
                found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
        prefix = f"elastic.{package}."
        edges[module] = {m for m in found if m.startswith(prefix) and (ROOT / (m.replace(".", "/") + ".py")).exists()}
    return edges


def test_transfer_imports_are_the_edges_tools_see() -> None:
    """issue 35: `elastic.transfer` hides no import behind a lazy name table. Importing any of
    its modules loads exactly the transfer modules its import statements reach (the package
    itself aside), so an import graph drawn from the code shows the real edges."""
    import json
    import subprocess
    import sys

    edges = _module_edges("transfer")
    assert "__getattr__" not in (ROOT / "elastic/transfer/__init__.py").read_text()

    def reach(module: str) -> set[str]:
        seen, todo = set(), [module]
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += edges.get(m, ())
        return seen

    modules = sorted(m for m in edges if m != "elastic.transfer")
    code = "\n".join([
        "import json, sys",
        "out = {}",
        "for m in sys.argv[1:]:",
        "    before = set(sys.modules)",
        "    __import__(m)",
        "    out[m] = sorted(n for n in set(sys.modules) - before if n.startswith('elastic.transfer.'))",
        "    for n in out[m]:",  # forget them, so that the next module's import loads what it needs again
        "        sys.modules.pop(n)",
        "        vars(sys.modules['elastic.transfer']).pop(n.rsplit('.', 1)[1], None)",
        "print(json.dumps(out))",
    ])
    run = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, timeout=120, check=True, cwd=ROOT)
    loaded = json.loads(run.stdout.strip().splitlines()[-1])
    assert {m: set(v) for m, v in loaded.items()} == {m: reach(m) for m in modules}
