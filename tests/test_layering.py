"""The import layering of SPEC §2 / docs/architecture.md, checked by parsing every module."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvcanary"

# layer -> the kvcanary layers it may import
ALLOWED = {
    "contract": {"contract"},
    "canary": {"contract", "canary"},
    "engine": {"contract", "engine"},
    "adapters": {"contract", "canary", "adapters"},
    "cli": {"contract", "canary", "engine", "adapters", "app", "cli"},
    "app": {"contract", "canary", "engine", "adapters", "app"},
    "__init__": set(),
}
THIRD_PARTY_FORBIDDEN = {"contract": {"numpy", "numba", "typer", "rich", "vllm"}}


def layer_of(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py")


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_every_module_respects_the_layering() -> None:
    problems = []
    modules = sorted(SRC.rglob("*.py"))
    assert len(modules) > 20
    for path in modules:
        layer = layer_of(path)
        assert layer in ALLOWED, f"{path}: unknown layer {layer!r}; add it to ALLOWED"
        for name in imports(path):
            top = name.split(".")
            if top[0] == "kvcanary" and len(top) > 1:
                target = top[1]
                if target not in ALLOWED[layer] and target != "__version__":
                    problems.append(f"{path.relative_to(SRC)} imports {name}")
            if top[0] in THIRD_PARTY_FORBIDDEN.get(layer, set()):
                problems.append(f"{path.relative_to(SRC)} imports {name}")
    assert problems == []


def test_importing_kvcanary_does_not_import_vllm_or_engine() -> None:
    import subprocess
    import sys

    code = "import sys, kvcanary, kvcanary.canary; print(sorted(m for m in sys.modules if m.startswith(('vllm', 'kvcanary.engine'))))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
