"""The `_torch_compat` package's shape: its `__init__` only re-exports, every name has one binding
(in the submodule that defines it, with its torch-version variant chosen there), and code outside
the package imports the package alone. A name bound twice could differ between `tc.NAME` and the
submodule's own, so the 2.11/2.12 shim would reach some callers and not others."""

from __future__ import annotations

import ast
import importlib
import types
from pathlib import Path

from autoshard import _torch_compat as tc

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autoshard" / "_torch_compat"
SUBMODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def submodule(name: str) -> types.ModuleType:
    return importlib.import_module(f"autoshard._torch_compat.{name}")


def _reexports() -> dict[str, str]:
    """{name: submodule} of every `from autoshard._torch_compat.<submodule> import name` in `__init__`."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        assert isinstance(node, ast.ImportFrom), f"__init__ line {node.lineno} does more than re-export"
        sub = (node.module or "").removeprefix("autoshard._torch_compat.")
        assert sub in SUBMODULES, f"__init__ line {node.lineno} imports from {node.module}"
        for alias in node.names:
            assert alias.asname in (None, alias.name), f"{alias.name} is renamed in __init__"
            assert alias.name not in out, f"{alias.name} is re-exported twice"
            out[alias.name] = sub
    return out


def _bindings(sub: str) -> dict[str, set[str]]:
    """The names `sub` binds at module level, inside `if` blocks too (where torch-version variants
    are chosen): "defined" (def, class, assignment), "imported" (from torch and the standard
    library), "from_siblings", and "siblings_written" (`sibling.attr = ...`, as 'sibling.attr')."""
    found: dict[str, set[str]] = {
        "defined": set(),
        "imported": set(),
        "from_siblings": set(),
        "siblings_written": set(),
    }
    statements = list(ast.parse((PACKAGE / f"{sub}.py").read_text(encoding="utf-8")).body)
    while statements:
        node = statements.pop()
        if isinstance(node, ast.If | ast.Try | ast.With):
            statements += [*node.body, *getattr(node, "orelse", ()), *getattr(node, "finalbody", ())]
        elif isinstance(node, ast.ImportFrom):
            sibling = node.level > 0 or (node.module or "").startswith("autoshard._torch_compat")
            found["from_siblings" if sibling else "imported"].update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found["imported"].update(a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found["defined"].add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    found["defined"].add(target.id)
                elif isinstance(target, ast.Attribute) and ast.unparse(target.value) in SUBMODULES:
                    found["siblings_written"].add(ast.unparse(target))
    return found


def test_init_reexports_each_name_from_its_defining_submodule():
    exports = _reexports()
    assert exports, "no re-exports found"
    for name, sub in exports.items():
        assert getattr(tc, name) is getattr(submodule(sub), name), f"tc.{name} is not {sub}.{name}"
        found = _bindings(sub)
        assert name in found["defined"] | found["imported"], f"{sub} does not bind {name} itself"
        assert name not in found["from_siblings"], f"{sub} re-exports {name} from a sibling"
    inner = {submodule(sub) for sub in SUBMODULES}
    public = {n for n, v in vars(tc).items() if not n.startswith("__") and v not in inner}
    assert public == set(exports), "tc has names its re-exports do not account for"


def test_no_name_is_defined_in_two_submodules_nor_rebound_from_a_sibling():
    defined: dict[str, list[str]] = {}
    for sub in SUBMODULES:
        found = _bindings(sub)
        assert found["siblings_written"] == set(), f"{sub} assigns to a sibling's names"
        for name in found["defined"]:
            if not name.startswith("_"):
                defined.setdefault(name, []).append(sub)
    assert {n: subs for n, subs in defined.items() if len(subs) > 1} == {}


def test_each_version_variant_reaches_every_caller():
    legacy, runtime, collectives = submodule("legacy"), submodule("runtime"), submodule("collectives")
    assert tc.mem_tracker is runtime.mem_tracker
    assert (tc.mem_tracker is legacy.mem_tracker_2_12) == (legacy.TORCH < (2, 13))
    assert tc.all_gather_now is collectives.all_gather_now
    assert hasattr(tc.all_gather_now, "__wrapped__") == (legacy.TORCH < (2, 12))  # the 2.11 dense-input wrapper


def test_callers_import_the_package_alone():
    """Code outside the package names `autoshard._torch_compat`, never one of its submodules (nor
    the single-file modules it replaced)."""
    bad = []
    for folder in ("autoshard", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if PACKAGE in path.parents:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                for name in names:
                    parts = name.split(".")
                    if parts[:2] == ["autoshard", "_torch_compat"] and parts[2:3] and parts[2] in SUBMODULES:
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
                    elif len(parts) > 1 and parts[0] == "autoshard" and parts[1].startswith("_torch_compat_"):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert bad == []


def test_shardwise_adamw_steps_dtensors_bit_for_bit_as_torchs_adamw():
    """On a simulated (2,2) mesh, parameters sharded and replicated: three steps of AdamW stepped
    on the local shards leave the parameters and both moments equal, bit for bit, to torch's AdamW
    stepped through DTensor's dispatch, in both param groups (with and without decay)."""
    import torch
    from torch.distributed.tensor import distribute_tensor

    from simulation import simulated_mesh

    g = torch.Generator().manual_seed(0)
    full = [torch.randn(8, 6, generator=g), torch.randn(6, generator=g), torch.randn(4, 8, generator=g)]
    grads = [[torch.randn(t.shape, generator=g) for t in full] for _ in range(3)]
    with simulated_mesh((2, 2)) as (mesh, mode):
        placements = [(tc.Shard(0), tc.Shard(1)), (tc.Replicate(), tc.Replicate()), (tc.Shard(1), tc.Replicate())]
        runs = []
        for cls in (torch.optim.AdamW, tc.ShardwiseAdamW):
            params = [torch.nn.Parameter(distribute_tensor(t, mesh, p)) for t, p in zip(full, placements)]
            groups = [{"params": params[::2], "weight_decay": 0.1}, {"params": params[1:2], "weight_decay": 0.0}]
            optim = cls(groups, lr=1e-2, betas=(0.9, 0.95), fused=True)
            for step in grads:
                for p, grad, lay in zip(params, step, placements):
                    p.grad = distribute_tensor(grad, mesh, lay)
                optim.step()
                optim.zero_grad()
            runs.append((params, optim))
        (ref, ref_optim), (ours, our_optim) = runs
        for a, b in zip(ref, ours):
            assert b.placements == a.placements
            for x, y in [(a, b), *((ref_optim.state[a][k], our_optim.state[b][k]) for k in ("exp_avg", "exp_avg_sq"))]:
                with mode.disable():
                    for u, v in zip(per_rank(x), per_rank(y)):
                        assert torch.equal(u, v)
        with mode.disable():
            assert not torch.equal(per_rank(ours[0])[0], full[0][:4, :3])  # it did step


def per_rank(value) -> list:
    """A DTensor's local values, rank by rank (one where every rank holds the same tensor)."""
    local = value.detach().to_local()
    return list(tc.rank_values(local).values()) if isinstance(local, tc.LocalTensor) else [local]


def test_the_norm_and_the_clip_run_on_shards_as_torchs_do_on_dtensors():
    """On a simulated (2,2) mesh, gradients sharded on either dim, on both (in either device
    order: one dim's placement is then a `_StridedShard`), replicated and uneven:
    the trainer's global norm equals torch's `get_total_norm` over the DTensors (to rounding:
    the squares are summed in another order), clipping scales every shard by torch's factor, and
    neither dispatches a single op on a DTensor."""
    import math

    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    from autoshard.train.optimizer import GradClip
    from simulation import simulated_mesh

    class NoDTensorOps(tc.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            leaves = torch.utils._pytree.tree_leaves((args, kwargs or {}))
            assert not any(isinstance(x, DTensor) for x in leaves), func
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    full = [torch.randn(8, 6, generator=g), torch.randn(6, generator=g), torch.randn(5, 8, generator=g)]
    full.append(torch.randn(4, 4, generator=g))
    full.append(torch.randn(4, 8, generator=g))  # its dim 1 split over mesh dim 1 first, then mesh dim 0
    with simulated_mesh((2, 2)) as (mesh, mode):
        placements = [(tc.Shard(0), tc.Shard(1)), (tc.Replicate(), tc.Replicate()), (tc.Shard(0), tc.Replicate())]
        placements.append((tc.Replicate(), tc.Shard(0)))
        grads = [distribute_tensor(t, mesh, p) for t, p in zip(full, placements)]  # all but the last
        placements.append(tc.strided_placements(((1, (1, 0)),), (tc.Shard(1), tc.Shard(1)), (2, 2)))
        grads.append(distribute_tensor(full[-1], mesh, placements[-1], src_data_rank=None))
        params = [torch.nn.Parameter(torch.empty_like(x)) for x in grads]
        for p, grad in zip(params, grads):
            p.grad = grad.clone()
            if not isinstance(grad.to_local(), tc.LocalTensor):  # a simulated replica: one tensor for all ranks
                own = tc.LocalTensor({rank: grad.to_local().clone() for rank in range(4)})  # a real rank's own
                p.grad = DTensor.from_local(own, mesh, grad.placements)
        theirs = torch.nn.utils.get_total_norm(grads).full_tensor()
        with NoDTensorOps():
            ours = GradClip(max_norm=1.0)(params).value
        with mode.disable():
            norms = list(tc.rank_values(ours).values())  # a plain tensor on every rank, the same
            assert len(norms) == 4 and all(torch.equal(n, norms[0]) for n in norms)
            assert math.isclose(norms[0].item(), list(tc.rank_values(theirs).values())[0].item(), rel_tol=1e-6)
            assert math.isclose(norms[0].item(), math.sqrt(sum(t.pow(2).sum().item() for t in full)), rel_tol=1e-6)
            factor = 1.0 / (norms[0] + 1e-6)
            for p, grad in zip(params, grads):
                for shard, ref in zip(per_rank(p.grad), per_rank(grad)):
                    assert torch.equal(shard, ref * factor)
