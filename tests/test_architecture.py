"""The one-way dependency rules of docs/architecture.md, as import-linter contracts (pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_layer_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Contracts: 9 kept, 0 broken." in proc.stdout


KNOWN_CYCLES = [{"roboscale.models.policy", "roboscale.models.registry"}]
"""The one import cycle left, and why: the registry names every policy class, and ``Policy.from_pretrained`` asks
it which class a checkpoint's ``type`` is (a lazy import inside the method)."""


def strongly_connected(graph, modules: set[str]) -> list[set[str]]:
    """Tarjan's components of more than one module: the import cycles (type-only and function-level imports
    included: each is an arrow a reader of the code follows)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(component)

    for module in sorted(modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_module_imports_itself_through_others():
    """No import cycles but the known one: a cycle is two modules that cannot be read, tested or moved apart
    (``BuildContext``, ``flow_matching_loss`` and the Trainer's six-file cycle were removed, issue 32)."""
    import grimp

    graph = grimp.build_graph("roboscale")
    assert sorted(map(sorted, strongly_connected(graph, set(graph.modules)))) == sorted(map(sorted, KNOWN_CYCLES))
