"""The house's shape: every import between packages (function-level ones included) is an arrow the
table below allows, no module takes part in an import circle, `solver/` imports no torch (nor
autoshard, nor models), `models/` imports no autoshard, and private torch APIs appear only in
the `autoshard/_torch_compat/` package. docs/architecture.md shows the same table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# package (or top-level module) of autoshard -> what it may import; `solver` and `models` are the
# sibling packages. Stages compute, drivers (driver, train, cli) call them; nothing points back up.
STAGES = (
    "_torch_compat",
    "layout",
    "options",
    "fileio",
    "profiles",
    "capture",
    "strategies",
    "pricing",
    "problem",
    "pipeline",
    "program",
    "runtime",
)
ALLOWED: dict[str, set[str]] = {
    "_torch_compat": set(),
    "options": set(),
    "fileio": set(),
    "layout": {"_torch_compat"},
    "profiles": {"_torch_compat", "fileio"},
    "capture": {"_torch_compat", "layout"},
    "strategies": {"_torch_compat", "layout", "models"},  # models: the ops a model family defines
    "pricing": {"_torch_compat", "layout", "profiles", "strategies"},
    "problem": {"_torch_compat", "layout", "profiles", "capture", "strategies", "pricing", "solver"},
    "pipeline": {"capture", "problem"},
    "program": {"_torch_compat", "layout", "profiles", "capture", "strategies", "pricing", "problem", "models"},
    "runtime": {"_torch_compat", "layout", "profiles", "capture", "pricing", "problem", "program"},
    "report": {
        *("_torch_compat", "fileio", "layout", "profiles", "capture", "pricing", "problem", "pipeline"),
        *("program", "runtime", "strategies"),
    },
    "workloads": {"_torch_compat", "fileio", "models", "options"},
    "data": {"options", "fileio"},
    "driver": {*STAGES, "solver"},
    "train": {*STAGES, "driver", "report", "workloads", "data", "models"},
    "cli": {*STAGES, "driver", "report", "workloads", "train", "models"},
    "__main__": {"cli"},
    "__init__": {"driver", "layout", "problem", "runtime"},
}
SIBLINGS = ("solver", "models")
# the import name of each top-level folder: the siblings are installed under names no other project
# uses (pyproject's package-dir), so a user's own `models` or `solver` package cannot shadow them
IMPORT_NAMES = {"autoshard": "autoshard", "solver": "autoshard_solver", "models": "autoshard_models"}
FOLDER_OF = {name: folder for folder, name in IMPORT_NAMES.items()}


def package_of(module: str) -> str | None:
    """'autoshard.problem.build' -> 'problem'; 'autoshard' (the package itself) -> '__init__';
    'autoshard_solver.io' -> 'solver'; None for anything else (torch, the standard library...)."""
    parts = module.split(".")
    if parts[0] == "autoshard":
        return parts[1] if len(parts) > 1 else "__init__"
    return FOLDER_OF.get(parts[0]) if FOLDER_OF.get(parts[0]) in SIBLINGS else None


def imported_modules(source: str, module: str, known: set[str] = frozenset()) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source` (function-level ones too), relative
    ones resolved; `from a import b` names `a.b` when that is one of the `known` modules."""
    package = module.rsplit(".", 1)[0] if not module.endswith("__init__") else module.removesuffix(".__init__")
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [(node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in known else base) for a in node.names]
    return found


def forbidden_arrows(source: str, module: str) -> list[str]:
    """Imports of `module` that cross to a package the table does not allow."""
    own = package_of(module)
    out = []
    for line, target in imported_modules(source, module, KNOWN):
        to = package_of(target)
        if to is None or to == own or own in SIBLINGS:
            continue
        if to not in ALLOWED.get(own, set()):
            out.append(f"{module}:{line} imports {target} ({own} -> {to} is not allowed)")
    return out


def circles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The import circles among modules (strongly connected groups of two or more, or a module
    importing itself), each sorted; `imports` maps a module to the modules it imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in imports.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in imports.get(node, ()):
                found.append(sorted(group))

    for node in sorted(imports):
        if node not in index:
            visit(node)
    return found


def _modules(*folders: str):
    """(import name, source) of every module under the top-level `folders`."""
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join((IMPORT_NAMES[folder], *rel.parts[1:]))
            yield name.removesuffix(".__init__"), path.read_text(encoding="utf-8")


def module_imports(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules of `sources` it imports (an import of `a.b.c` counts as one of the
    longest known prefix: a package's __init__ when the module is not known)."""
    known = set(sources)
    out = {}
    for module, src in sources.items():
        targets = set()
        for _, target in imported_modules(src, module + (".__init__" if _is_package(module) else ""), known):
            parts = target.split(".")
            while parts and ".".join(parts) not in known:
                parts.pop()
            if parts and ".".join(parts) != module:
                targets.add(".".join(parts))
        out[module] = targets
    return out


def _is_package(module: str) -> bool:
    top, *rest = module.split(".")
    return (ROOT / FOLDER_OF.get(top, top) / "/".join(rest) / "__init__.py").exists()


KNOWN = frozenset(name for name, _ in _modules("autoshard", "solver", "models"))


def test_every_autoshard_package_is_in_the_table():
    for module, _ in _modules("autoshard"):
        assert package_of(module) in ALLOWED, f"{module} is in no package of the table"


def test_every_arrow_is_allowed():
    problems = [
        p
        for module, src in _modules("autoshard")
        for p in forbidden_arrows(src, module + (".__init__" if _is_package(module) else ""))
    ]
    assert problems == []


def test_no_import_circles():
    assert circles(module_imports(dict(_modules("autoshard", "solver", "models")))) == []


def test_the_checks_catch_a_forbidden_arrow_and_a_circle():
    src = "import torch\nfrom autoshard.layout import Layout\ndef f():\n    from ..program.lower import lower\n"
    assert forbidden_arrows(src, "autoshard.problem.plan") == [
        "autoshard.problem.plan:4 imports autoshard.program.lower (problem -> program is not allowed)"
    ]
    assert forbidden_arrows("import autoshard_solver", "autoshard.runtime.module") == [
        "autoshard.runtime.module:1 imports autoshard_solver (runtime -> solver is not allowed)"
    ]
    assert forbidden_arrows("from autoshard import AutoShard", "autoshard.runtime.module")  # the root is a driver
    assert forbidden_arrows("from autoshard import _torch_compat as tc", "autoshard.layout") == []
    assert forbidden_arrows("from autoshard.problem.plan import Plan", "autoshard.program.lower") == []
    sources = {
        "pkg.a": "from pkg import b\n",
        "pkg.b": "def f():\n    from .c import x\n",
        "pkg.c": "import pkg.a\n",
        "pkg.d": "import pkg.a\n",
    }
    assert circles(module_imports(sources)) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert circles(module_imports({"pkg.a": "from pkg import b\n", "pkg.b": "import os\n"})) == []


def test_solver_imports_no_torch_and_models_no_autoshard():
    for package, banned in (
        ("solver", ("torch", "autoshard", "autoshard_models")),
        ("models", ("autoshard", "autoshard_solver")),
    ):
        for module, src in _modules(package):
            bad = [t for _, t in imported_modules(src, module) if t.split(".")[0] in banned]
            assert bad == [], f"{module} imports {bad}"


_PRIVATE = re.compile(r"\btorch(?:\.[A-Za-z]\w*)*\._\w+")


def private_torch_uses(source: str) -> list[str]:
    """`torch.x._y` names (attribute chains or import paths) in `source`."""
    return _PRIVATE.findall(source)


def test_private_torch_apis_only_in_torch_compat():
    assert private_torch_uses("from torch.distributed._tools import x; torch._ops.OpOverload") == [
        "torch.distributed._tools",
        "torch._ops",
    ]
    # only the modules of the `_torch_compat` package may use them
    uses = {
        module: private_torch_uses(src)
        for module, src in _modules("autoshard")
        if package_of(module) != "_torch_compat"
    }
    assert {m: u for m, u in uses.items() if u} == {}


def test_every_package_folder_is_installed_under_its_import_name():
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = sorted(
        ".".join(p.parent.relative_to(ROOT).parts)
        for folder in IMPORT_NAMES
        for p in (ROOT / folder).rglob("__init__.py")
    )
    want = sorted(".".join((IMPORT_NAMES[f.split(".")[0]], *f.split(".")[1:])) for f in folders)
    assert sorted(tool["packages"]) == want
    assert tool["package-dir"] == {name: folder for folder, name in IMPORT_NAMES.items() if name != folder}
    # every directory of Python modules is a package (a namespace folder would be left out of a wheel)
    assert {p.parent for folder in IMPORT_NAMES for p in (ROOT / folder).rglob("*.py")} == {
        ROOT.joinpath(*f.split(".")) for f in folders
    }
