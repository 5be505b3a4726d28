"""The package has no import cycles: every module imports only modules that do not import it back
(imports inside functions count too, since they are cycles hidden until run time)."""

import ast
from pathlib import Path

import doublesparse

ROOT = Path(doublesparse.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    mods = {}
    for f in ROOT.rglob("*.py"):
        parts = ("doublesparse",) + f.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = {f"{mod}.{a.name}" for a in node.names} & set(mods)
            # "from pkg import submodule" depends on the submodule, not on the package's body
            out |= subs if subs and len(subs) == len(node.names) else {mod} | subs
    return {m for m in out if m in mods and m != name}


def test_no_import_cycles():
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


# what stands below what: the engine and the layers under it import none of the tools and
# commands that build and run it (those hand it what it needs: see doublesparse/api.py)
BELOW = ("doublesparse.engine", "doublesparse.channels", "doublesparse.models", "doublesparse.attention",
         "doublesparse.kernels", "doublesparse.testing")
ABOVE = ("doublesparse.calibrate", "doublesparse.distributed", "doublesparse.eval", "doublesparse.bench",
         "doublesparse.server", "doublesparse.api")


def _within(mod: str, roots) -> bool:
    return any(mod == r or mod.startswith(r + ".") for r in roots)


def test_the_engine_imports_nothing_above_it():
    mods = _modules()
    up = sorted(f"{m} -> {w}" for m, p in mods.items() if _within(m, BELOW)
                for w in _imports(m, p, mods) if _within(w, ABOVE))
    assert not up, f"imports that run up: {up}"


KERNEL_DOORS = ("doublesparse.kernels.triton", "doublesparse.kernels.cuda")


def test_kernels_are_reached_through_their_doors():
    """Outside kernels/, the launchers are reached through kernels.ops (whole calls) and
    kernels.parts (the pieces composed backends assemble), never kernels/triton or kernels/cuda."""
    mods = _modules()
    inside = sorted(f"{m} -> {w}" for m, p in mods.items() if not _within(m, ("doublesparse.kernels",))
                    for w in _imports(m, p, mods) if _within(w, KERNEL_DOORS))
    assert not inside, f"reaching past the kernel doors: {inside}"


def test_no_private_names_across_files():
    """No module imports another module's underscore-private name (``from x import _y`` or
    ``module._y`` of an imported package module)."""
    mods = _modules()
    found = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        found.append(f"{name}: from {node.module} import {a.name}")
                    aliases[a.asname or a.name] = a.name
            elif isinstance(node, ast.Import):
                for a in node.names:
                    aliases[a.asname or a.name.split(".")[0]] = a.name
        pkg_mods = {k for k, v in aliases.items() if any(m.endswith("." + v) or m == v for m in mods)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in pkg_mods
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{name}: {node.value.id}.{node.attr}")
    assert not found, found
