"""The simulator must run the production policy code, never its own copy of it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SIM = sorted((ROOT / "plora" / "simulator").glob("*.py"))
PRODUCTION = {
    "plora.traces": ROOT / "plora/traces.py",
    "services.predictor.forecast": ROOT / "services/predictor/forecast.py",
    "services.worker.pool": ROOT / "services/worker/pool.py",
    "services.worker.eviction": ROOT / "services/worker/eviction.py",
    "services.worker.store": ROOT / "services/worker/store.py",
    "services.predictor.placement": ROOT / "services/predictor/placement.py",
    "services.common.routing": ROOT / "services/common/routing.py",
}
#: What the simulator must import from each production module (the policy entry points).
REQUIRED_IMPORTS = {
    "plora.traces": {"map_keys_to_adapters"},
    "services.predictor.forecast": {"make_forecaster"},
    "services.worker.pool": {"make_allocator"},
    "services.worker.eviction": {"make_policy", "Candidate"},
    "services.worker.store": {"HostCache"},
    "services.predictor.placement": {"plan_placement", "PrefetchSelector"},
    "services.common.routing": {"RoutingState"},
}  # fmt: skip
#: Base classes of the production policies: a simulator class deriving from one is a copy.
POLICY_BASES = {
    "Allocator",
    "EvictionPolicy",
    "Forecaster",
    "RoundRobinRouter",
    "RoutingState",
    "PrefetchSelector",
    "HostCache",
}
#: Words that name a policy component; a simulator class named with one is its own copy.
POLICY_WORDS = ("allocator", "eviction", "evictor", "forecaster", "placement", "router", "lru")


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text("utf-8"), filename=str(path))


def _defined(tree: ast.Module) -> set[str]:
    """Top-level classes and functions, and the methods of top-level classes."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


def _all_defs(tree: ast.Module) -> list[ast.AST]:
    return [
        n for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    ]  # fmt: skip


def _imports(trees: list[ast.Module]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                out.setdefault(node.module, set()).update(a.name for a in node.names)
    return out


def test_simulator_modules_exist() -> None:
    assert {p.name for p in SIM} >= {"engine.py", "presets.py", "run.py", "report.py"}


def test_no_simulator_def_shadows_a_production_name() -> None:
    missing = [m for m, p in PRODUCTION.items() if not p.exists()]
    if missing:
        pytest.fail(f"production modules missing: {missing}")
    production = set().union(*(_defined(_tree(p)) for p in PRODUCTION.values()))
    clashes = []
    for path in SIM:
        for node in _all_defs(_tree(path)):
            if node.name in production and not node.name.startswith("__"):
                clashes.append(f"{path.name}: {node.name}")  # type: ignore[attr-defined]
    assert not clashes, f"simulator redefines production names: {clashes}"


def test_simulator_imports_the_production_policies() -> None:
    imports = _imports([_tree(p) for p in SIM])
    for module, names in REQUIRED_IMPORTS.items():
        got = imports.get(module, set())
        assert names <= got, f"simulator must import {sorted(names - got)} from {module}"


def test_no_own_policy_classes() -> None:
    bad = []
    for path in SIM:
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {
                b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
            }
            if bases & POLICY_BASES:
                bad.append(f"{path.name}: {node.name} derives from {sorted(bases & POLICY_BASES)}")
            if any(w in node.name.lower() for w in POLICY_WORDS):
                bad.append(f"{path.name}: class {node.name} names a policy component")
    assert not bad, bad


def test_simulator_does_not_reimplement_policy_functions() -> None:
    """No simulator function is named like a policy routine (ordering, routing, first fit)."""
    words = (
        "lru_order",
        "predictive_order",
        "first_fit",
        "plan_compaction",
        "route",
        "rank_cost",
        "forecast",
    )
    bad = []
    for path in SIM:
        for node in _all_defs(_tree(path)):
            if isinstance(node, ast.ClassDef):
                continue
            name = node.name.lower()  # type: ignore[attr-defined]
            if any(name == w or name == f"_{w}" for w in words):
                bad.append(f"{path.name}: {node.name}")  # type: ignore[attr-defined]
    assert not bad, bad
