"""Data flows one way: a stage never imports a later stage, `solver/` imports no torch (nor
autoshard, nor models), `models/` imports no autoshard, and private torch APIs appear only in
`autoshard/_torch_compat.py`. Imports inside functions count too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Stage order of autoshard's packages and top-level modules (DESIGN.md): lower may not import higher.
STAGES = ["_torch_compat", "layout", "workload", "hf", "profiles", "capture", "strategies", "pricing", "problem",
          "program", "runtime", "report", "api", "cli", "__main__", "__init__"]
FOUNDATION = {"_torch_compat": 0, "layout": 1, "workload": 1, "hf": 1}  # these may use _torch_compat and each other only


def _rank(stage: str) -> int:
    return FOUNDATION.get(stage, STAGES.index(stage))


def stage_of(module: str) -> str | None:
    """'autoshard.problem.build' -> 'problem'; 'autoshard' (the package itself) -> '__init__'."""
    parts = module.split(".")
    if parts[0] != "autoshard":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, relative ones resolved."""
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
            if base == "autoshard":  # `from autoshard import api` imports a stage; `import AutoShard`, the root
                found += [(node.lineno, f"autoshard.{a.name}" if a.name in STAGES else base) for a in node.names]
            else:
                found.append((node.lineno, base))
    return found


def back_edges(source: str, module: str) -> list[str]:
    """Imports of `module` that point to a later stage than its own."""
    own = stage_of(module)
    out = []
    for line, target in imported_modules(source, module):
        stage = stage_of(target)
        if stage is None or stage == own or stage not in STAGES:
            continue
        if _rank(stage) > _rank(own) or (own in FOUNDATION and stage not in FOUNDATION):
            out.append(f"{module}:{line} imports {target} (stage {stage} comes after {own})")
    return out


def _modules(package: str):
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        yield ".".join(rel.parts), path.read_text(encoding="utf-8")


def test_every_autoshard_module_belongs_to_a_stage():
    for module, _ in _modules("autoshard"):
        assert stage_of(module) in STAGES, f"{module} is in no stage of {STAGES}"


def test_no_stage_imports_a_later_stage():
    problems = [p for module, src in _modules("autoshard") for p in back_edges(src, module)]
    assert problems == []


def test_the_check_catches_a_back_edge():
    src = "import torch\nfrom autoshard.layout import Layout\ndef f():\n    from ..program.lower import lower\n"
    assert back_edges(src, "autoshard.problem.plan") == [
        "autoshard.problem.plan:4 imports autoshard.program.lower (stage program comes after problem)"]
    assert back_edges("from autoshard import AutoShard", "autoshard.runtime.module")  # the root comes last
    assert back_edges("from autoshard.capture.trace import JointGraph", "autoshard.layout")
    assert back_edges("from autoshard.problem.plan import Plan", "autoshard.program.lower") == []


def test_solver_imports_no_torch_and_models_no_autoshard():
    for package, banned in (("solver", ("torch", "autoshard", "models")), ("models", ("autoshard",))):
        for module, src in _modules(package):
            bad = [t for _, t in imported_modules(src, module) if t.split(".")[0] in banned]
            assert bad == [], f"{module} imports {bad}"


_PRIVATE = re.compile(r"\btorch(?:\.[A-Za-z]\w*)*\._\w+")


def private_torch_uses(source: str) -> list[str]:
    """`torch.x._y` names (attribute chains or import paths) in `source`."""
    return _PRIVATE.findall(source)


def test_private_torch_apis_only_in_torch_compat():
    assert private_torch_uses("from torch.distributed._tools import x; torch._ops.OpOverload") == [
        "torch.distributed._tools", "torch._ops"]
    uses = {module: private_torch_uses(src) for module, src in _modules("autoshard")
            if module != "autoshard._torch_compat"}
    assert {m: u for m, u in uses.items() if u} == {}
