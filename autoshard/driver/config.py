"""How to plan: one `PlanConfig` for the API, `plan` and `train`.

    config = PlanConfig(mesh=(8, 8), param_dtype="bf16", reduce_dtype="fp32", memory_limit=70 * 2**30)
    AutoShard(model, input_fn, config=config)       # or keyword arguments as sugar

Every field that is also a command-line flag is declared here once (`autoshard.options.setting`):
`plan` and `train` generate their flags from this class, so a new planning knob is one field.
The mesh is a shape with one name per dim, and the name is the dim's role (`pp`, first when
named: pipeline stages, `driver.pipeline`; `dp_replicate`, `dp_shard`, `tp`, `cp`, or `dp` for
`dp_shard`); unnamed meshes of 1 to 3 dims get `dp`, `dp,tp` or
`dp_replicate,dp_shard,tp` (HSDP x TP), and no role is ever invented beyond those. The data
splits over the data-parallel dims (`check_batch`). A bad value raises ValueError when the config
is made.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from autoshard.capture.precision import Precision, dtype_name, parse_dtype
from autoshard.options import name_list, parse_bytes, parse_limit, parse_mesh, positive_float, setting
from autoshard.profiles.device import DeviceProfile
from autoshard.profiles.network import NetworkProfile

ROLES = ("pp", "dp_replicate", "dp_shard", "tp", "cp")  # what a mesh dim is for
ROLE_OF_NAME = {"dp": "dp_shard"}  # names that are not roles themselves but mean one
# an unnamed mesh's dims, by how many it has: what the docs' examples use
DEFAULT_MESH_NAMES = {1: ("dp",), 2: ("dp", "tp"), 3: ("dp_replicate", "dp_shard", "tp")}
BACKENDS = ("auto", "highs", "cbc")
Mesh = Union[DeviceMesh, Sequence[int]]  # a DeviceMesh to run on, or only a shape to plan for
MEMORY_RESERVE = 0.10  # of a device's capacity kept free: allocator slack, collective buffers, context
# profiles when none is named: planning for GPUs (the API, `plan`) or for where `train` runs
DEFAULT_PROFILES = {"cuda": ("h100-node", "h100"), "cpu": ("cpu-gloo", "cpu")}


def mesh_names(names: str | Sequence[str] | None, mesh: Sequence[int]) -> tuple[str, ...]:
    """The mesh dims' names: `names` ('dp,tp' or a sequence), or by default `DEFAULT_MESH_NAMES`
    for the mesh's number of dims. Each name is a role (`ROLES`, or `dp` for dp_shard), each role
    once: ValueError otherwise, since a mistyped role would silently plan something else."""
    mesh_text = "x".join(map(str, mesh))
    if names is None and len(mesh) not in DEFAULT_MESH_NAMES:
        raise ValueError(
            f"mesh {mesh_text} has {len(mesh)} dims: name them with --mesh-names "
            f"(unnamed meshes have at most {max(DEFAULT_MESH_NAMES)})"
        )
    if names is None:
        found = DEFAULT_MESH_NAMES[len(mesh)]
    else:
        found = name_list(names) if isinstance(names, str) else tuple(str(n).strip() for n in names)
    text = ",".join(found)
    if len(found) != len(mesh) or len(set(found)) != len(found) or not all(found):
        raise ValueError(f"--mesh-names {text!r} must give {len(mesh)} distinct names, one per dim of mesh {mesh_text}")
    roles = [ROLE_OF_NAME.get(name, name) for name in found]
    for name, role in zip(found, roles):
        if role not in ROLES:
            raise ValueError(
                f"--mesh-names {text!r}: unknown role {name!r}; each mesh dim is one of "
                f"{', '.join(ROLES)} (dp means dp_shard)"
            )
        if roles.count(role) > 1:
            raise ValueError(
                f"--mesh-names {text!r}: role {role} is given twice (dp means dp_shard); each role names one mesh dim"
            )
    if "pp" in roles[1:]:
        raise ValueError(f"--mesh-names {text!r}: pp must name the first (outermost) mesh dim")
    if roles[:1] == ["pp"] and len(roles) == 1:
        raise ValueError(
            f"--mesh-names {text!r}: a pipeline needs a dim beside pp for its stages' layouts (e.g. pp,dp)"
        )
    return found


def role_of(name: str) -> str:
    """A mesh dim's role from its name (a role, or `dp` for dp_shard)."""
    return ROLE_OF_NAME.get(name, name)


def dtype_option(text: str) -> str:
    """A floating dtype's short name ('bf16', 'fp32', ...) from any name torch or we use for it."""
    return dtype_name(parse_dtype(text))


def mp_policy(
    param_dtype: str | torch.dtype | None,
    reduce_dtype: str | torch.dtype | None = None,
    *,
    output_dtype: str | torch.dtype | None = None,
    cast_forward_inputs: bool = True,
) -> MixedPrecisionPolicy | None:
    """torch's `MixedPrecisionPolicy` of these dtypes (names or dtypes); None when none is given."""
    if param_dtype is None and reduce_dtype is None and output_dtype is None:
        return None
    dtype = lambda v: parse_dtype(v) if isinstance(v, str) else v  # noqa: E731
    return MixedPrecisionPolicy(
        param_dtype=dtype(param_dtype),
        reduce_dtype=dtype(reduce_dtype),
        output_dtype=dtype(output_dtype),
        cast_forward_inputs=cast_forward_inputs,
    )


@dataclass(frozen=True)
class PlanConfig:
    """How to plan and what to plan for. `network` / `device_profile`: a preset name, a profile,
    or a profile file from `autoshard calibrate` (None: the presets of `DEFAULT_PROFILES`).
    Precision follows torch's `MixedPrecisionPolicy` (FSDP2's meaning): parameters and optimizer
    states stay in their dtype; compute and gathers run in `param_dtype`, gradients are reduced in
    `reduce_dtype`. `memory_limit`: peak bytes per rank (None: the device's capacity less
    `MEMORY_RESERVE`; inf: no limit): the ILP may replicate parameters wherever the fitted plan stays
    under it; `memory_budget`: an extra cap on parameter bytes per rank (None: none; total / world
    size forces full sharding, the FSDP level). `recompute` checkpoints every repeated block,
    `reshard_after_forward` gathers its parameters again in the backward; under a limit the fit
    may turn either on. `unroll=False` traces every repeated block instead of three (blocks whose
    code depends on their depth)."""

    mesh: tuple[int, ...] | None = setting(None, "--mesh", type=parse_mesh, help="mesh shape, e.g. 8x8, 2x2 or 4")
    mesh_names: tuple[str, ...] | None = setting(
        None,
        "--mesh-names",
        type=name_list,
        help="mesh dim roles, one per dim: pp (first), dp_replicate, dp_shard (or dp), tp, cp, each at most "
        "once (default: dp; dp,tp; dp_replicate,dp_shard,tp for 1, 2, 3 dims); parameters are replicated "
        "over dp_replicate, the batch splits over both dp dims, and `plan` and `train` cut the model into pipeline "
        "stages over pp",
    )
    network: NetworkProfile | str | None = setting(
        None,
        "--network",
        help="network profile for planning: a preset (h100-node, cpu-gloo) or a profile file "
        "from `autoshard calibrate` (default: h100-node; train: cpu-gloo on CPU)",
    )
    device_profile: DeviceProfile | str | None = setting(
        None,
        "--device",
        "--device-profile",
        help="device (compute) profile for planning: a preset (h100, h200, cpu) or a profile file from "
        "`autoshard calibrate` (default: h100; train: cpu on CPU)",
    )
    memory_budget: float | None = setting(
        None,
        "--memory-budget",
        type=parse_bytes,
        metavar="BYTES",
        help="cap on parameter bytes per rank, e.g. 2e9 or 16GiB (default: none; "
        "the memory limit bounds each rank's peak)",
    )
    memory_limit: float | None = setting(
        None,
        "--memory-limit",
        type=parse_limit,
        metavar="BYTES",
        help="peak memory per rank a plan must fit, e.g. 70GiB, or 'none' (default: the device profile's capacity "
        "less 10%%); the ILP then chooses layouts (replicated wherever they fit), resharding and activation "
        "checkpointing under it, checked by the dry run (`plan --no-dry-run`: on the modeled peak)",
    )
    param_dtype: str | torch.dtype | None = setting(
        None,
        "--param-dtype",
        type=dtype_option,
        metavar="DTYPE",
        help="mixed precision: compute and gather parameters in this dtype (bf16, fp16; parameters and optimizer "
        "states stay fp32; default: no cast)",
    )
    reduce_dtype: str | torch.dtype | None = setting(
        None,
        "--reduce-dtype",
        type=dtype_option,
        metavar="DTYPE",
        help="mixed precision: reduce gradients in this dtype (fp32, bf16; default: --param-dtype)",
    )
    output_dtype: str | torch.dtype | None = None  # MixedPrecisionPolicy.output_dtype (API only)
    cast_forward_inputs: bool = True  # MixedPrecisionPolicy.cast_forward_inputs (API only)
    recompute: bool = setting(
        False,
        "--recompute",
        help="activation checkpointing: the backward recomputes each repeated block's "
        "forward (parameters gathered again) instead of keeping its activations",
    )
    reshard_after_forward: bool = setting(
        False,
        "--reshard-after-forward",
        help="free the parameters each repeated block gathered once its forward is done and gather them again "
        "for its backward (FSDP's reshard_after_forward; implied by --recompute)",
    )
    backend: str = setting("auto", "--backend", choices=BACKENDS, help="ILP backend (default auto)")
    time_limit: float | None = setting(
        None, "--time-limit", type=positive_float, metavar="SECONDS", help="ILP time limit"
    )
    unroll: bool = True  # API only

    def __post_init__(self) -> None:
        if self.mesh is not None:
            shape = tuple(int(s) for s in self.mesh)
            if not shape or min(shape) < 1:
                raise ValueError(f"mesh shape must be non-empty with sizes >= 1, got {shape}")
            object.__setattr__(self, "mesh", shape)
            object.__setattr__(self, "mesh_names", mesh_names(self.mesh_names, shape))
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            dtype = parse_dtype(value) if isinstance(value, str) else value
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"{name} must be a floating-point dtype, got {value}")
        for name in ("memory_budget", "memory_limit", "time_limit"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name.replace('_', ' ')} must be positive, got {value}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown ILP backend {self.backend!r}; use one of {', '.join(BACKENDS)}")

    def replace(self, **changes: Any) -> PlanConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ the mesh
    def with_mesh(self, mesh: Mesh | None, stages: int = 1) -> PlanConfig:
        """This config with the shape (and names) of `mesh` (a DeviceMesh or a shape; None: its
        own); ValueError when neither gives one, when they disagree, or the world size differs
        from its size (or, for one of a pipeline's `stages`, from `stages` times its size: the
        whole pipeline's world)."""
        config = self
        if mesh is not None:
            shape = tuple(int(s) for s in (mesh.shape if isinstance(mesh, DeviceMesh) else mesh))
            if config.mesh is not None and config.mesh != shape:
                raise ValueError(f"the mesh {shape} differs from the config's {config.mesh}")
            names = getattr(mesh, "mesh_dim_names", None)
            if not names or not all(role_of(name) in ROLES for name in names):
                # a DeviceMesh's own labels, not roles
                names = config.mesh_names
            config = config.replace(mesh=shape, mesh_names=names if names and len(names) == len(shape) else None)
        if config.mesh is None:
            raise ValueError("no mesh: pass a DeviceMesh or a mesh shape, or a PlanConfig with one")
        world, size = _world_size(), math.prod(config.mesh)
        if world is not None and world not in (size, stages * size):
            raise ValueError(f"mesh {config.mesh} has {size} devices but the world size is {world}")
        return config

    @property
    def roles(self) -> tuple[str, ...]:
        """Each mesh dim's role."""
        return tuple(role_of(name) for name in self.mesh_names or ())

    @property
    def pipeline_ranks(self) -> int | None:
        """The size of the pp dim (the first, when there is one): None without one."""
        return self.mesh[0] if self.mesh is not None and self.roles[:1] == ("pp",) else None

    def stage_config(self) -> PlanConfig:
        """This config for one pipeline stage: the mesh without its pp dim (a network profile
        without that dim's link)."""
        assert self.mesh is not None and self.mesh_names is not None and self.pipeline_ranks is not None, "no pp dim"
        network = self.network.without(0) if isinstance(self.network, NetworkProfile) else self.network
        return self.replace(mesh=self.mesh[1:], mesh_names=self.mesh_names[1:], network=network)

    def without_pipeline(self) -> PlanConfig:
        """The same devices with no pp dim: its size folded into the first data-parallel dim, or a
        dp dim of its own in front when there is none (the plan a pipeline is weighed against)."""
        stage = self.stage_config()
        assert stage.mesh is not None and stage.mesh_names is not None and self.pipeline_ranks is not None
        dims = stage.data_parallel_dims
        if not dims:
            return stage.replace(mesh=(self.pipeline_ranks, *stage.mesh), mesh_names=("dp", *stage.mesh_names))
        mesh = list(stage.mesh)
        mesh[dims[0]] *= self.pipeline_ranks
        return stage.replace(mesh=tuple(mesh))

    @property
    def intra_node_dims(self) -> tuple[int, ...] | None:
        """The mesh dims a network preset puts inside a node: those of role tp (None: no tp dim,
        so the preset's default, the last dim)."""
        return tuple(d for d, role in enumerate(self.roles) if role == "tp") or None

    @property
    def replicate_dim(self) -> int | None:
        """The mesh dim of role dp_replicate, if there is one of size > 1: parameters are
        replicated over it and its placements are planned first (`driver.replicas`)."""
        dims = [d for d, role in enumerate(self.roles) if role == "dp_replicate" and self._size(d) > 1]
        return dims[0] if dims else None

    @property
    def data_parallel_dims(self) -> tuple[int, ...]:
        """The mesh dims the data splits over: those whose role is dp_replicate or dp_shard."""
        return tuple(d for d, role in enumerate(self.roles) if role in ("dp_replicate", "dp_shard"))

    def _size(self, dim: int) -> int:
        """The size of mesh dim `dim`, one the mesh's names gave a role."""
        assert self.mesh is not None, "mesh dims named without a mesh shape"
        return self.mesh[dim]

    def check_batch(self, batch: int) -> None:
        """ValueError unless the global batch splits evenly over the data-parallel dims."""
        dims = self.data_parallel_dims
        size = math.prod(self._size(d) for d in dims)
        if batch % size:
            names = self.mesh_names
            assert names is not None  # dims come from the names
            which = " x ".join(f"{d} '{names[d]}'" for d in dims)
            raise ValueError(
                f"--batch {batch} is not divisible by the dp size {size}: the batch splits over the "
                f"data-parallel mesh dims, and {batch} is not divisible by mesh dim"
                f"{'s' if len(dims) > 1 else ''} {which} of size {size}"
            )

    # ------------------------------------------------------------------ precision, profiles, memory
    @property
    def mp_policy(self) -> MixedPrecisionPolicy | None:
        return mp_policy(
            self.param_dtype,
            self.reduce_dtype,
            output_dtype=self.output_dtype,
            cast_forward_inputs=self.cast_forward_inputs,
        )

    @property
    def precision(self) -> Precision:
        return Precision.of(self.mp_policy)

    def with_policy(self, policy: MixedPrecisionPolicy | None) -> PlanConfig:
        """This config with torch's mixed precision policy (validated as `Precision.of` does)."""
        p = Precision.of(policy)
        return self.replace(
            param_dtype=p.param_dtype,
            reduce_dtype=p.reduce_dtype,
            output_dtype=p.output_dtype,
            cast_forward_inputs=p.cast_forward_inputs,
        )

    def with_default_profiles(self, device_type: str = "cuda") -> PlanConfig:
        """Profiles not named filled in with the presets for `device_type` (cuda: h100)."""
        network, device = DEFAULT_PROFILES["cuda" if device_type != "cpu" else "cpu"]
        return self.replace(
            network=self.network if self.network is not None else network,
            device_profile=self.device_profile if self.device_profile is not None else device,
        )

    def memory_limit_bytes(self, device: DeviceProfile) -> float | None:
        """The peak a plan must fit: the set limit, or the device's capacity less the reserve;
        None when there is none."""
        if self.memory_limit is not None:
            return None if math.isinf(self.memory_limit) else self.memory_limit
        return None if device.memory_bytes is None else device.memory_bytes * (1 - MEMORY_RESERVE)


def _world_size() -> int | None:
    """The process group's size (None: no process group)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
