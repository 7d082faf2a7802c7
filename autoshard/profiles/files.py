"""Profile files: what `autoshard calibrate` measured, as JSON that `--network` / `--device` and
`AutoShard(network=..., device=...)` accept in place of a preset name.

One file holds a network profile (for one mesh shape: its groups are that mesh's), a device
profile (for any mesh), or both, plus how they were measured: the raw timings and the fit's
error per group, so a user can see how far to trust them. A preset name or a path is resolved by
`network_profile` / `device_profile`; anything wrong with a file (missing, not JSON, not a
profile, no section of the kind asked for, made for another mesh shape) is one ValueError line
naming the file and the problem.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoshard.fileio import read_json, write_atomic
from autoshard.profiles.device import DeviceProfile
from autoshard.profiles.network import NetworkProfile

FORMAT = "autoshard-profile"
VERSION = 1


@dataclass(frozen=True)
class ProfileFile:
    """The contents of a profile file. `mesh_shape` is the mesh the network part was measured on
    (None without one); `details` is everything else (how, where, raw timings, fit errors)."""

    network: NetworkProfile | None = None
    device: DeviceProfile | None = None
    mesh_shape: tuple[int, ...] | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.network is None and self.device is None:
            raise ValueError("a profile file needs a network or a device profile")
        if self.network is not None:
            if self.mesh_shape is None or len(self.mesh_shape) != self.network.mesh_ndim:
                raise ValueError(
                    f"network profile of {self.network.mesh_ndim} mesh dims needs its mesh shape, got {self.mesh_shape}"
                )

    def to_json(self) -> dict:
        data: dict[str, Any] = {"format": FORMAT, "version": VERSION}
        if self.mesh_shape is not None:
            data["mesh"] = list(self.mesh_shape)
        if self.network is not None:
            n = self.network
            data["network"] = {
                "name": n.name,
                "alpha": list(n.alpha),
                "beta": list(n.beta),
                "launch_s": n.launch_s,
                "mem_bw": n.mem_bw,
                "groups": [{"mesh_dims": list(d), "alpha": a, "beta": b} for d, a, b in n.groups],
                "kinds": [{"kind": k, "mesh_dims": list(d), "alpha": a, "beta": b} for k, d, a, b in n.kinds],
            }
        if self.device is not None:
            d = self.device
            data["device"] = {
                "name": d.name,
                "peak_flops": d.peak_flops,
                "peak_flops_fp32": d.peak_flops_fp32,
                "mem_bw": d.mem_bw,
                "memory_bytes": d.memory_bytes,
                "op_overhead_s": d.op_overhead_s,
                "optimizer_rate": d.optimizer_rate,
                "host_op_s": d.host_op_s,
            }
        return data | {"details": self.details}

    @classmethod
    def from_json(cls, data: Any) -> ProfileFile:
        """Parse; ValueError (without the file name: the caller adds it) on anything malformed."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(
                f'not an autoshard profile (no "format": "{FORMAT}"; write one with `python -m autoshard calibrate`)'
            )
        if data.get("version") != VERSION:
            raise ValueError(f"profile format version {data.get('version')!r}, this autoshard reads {VERSION}")
        try:
            mesh = tuple(int(s) for s in data["mesh"]) if data.get("mesh") is not None else None
            network = device = None
            if data.get("network") is not None:
                n = data["network"]
                network = NetworkProfile(
                    tuple(n["alpha"]),
                    tuple(n["beta"]),
                    float(n["launch_s"]),
                    float(n["mem_bw"]),
                    str(n.get("name", "calibrated")),
                    groups=tuple((tuple(g["mesh_dims"]), g["alpha"], g["beta"]) for g in n.get("groups", ())),
                    kinds=tuple(
                        (str(g["kind"]), tuple(g["mesh_dims"]), g["alpha"], g["beta"]) for g in n.get("kinds", ())
                    ),
                )
            if data.get("device") is not None:
                d = data["device"]
                memory = d.get("memory_bytes")
                fp32 = d.get("peak_flops_fp32")
                rate = d.get("optimizer_rate")  # a file from before these fields: no overhead, mem_bw's rate
                device = DeviceProfile(
                    peak_flops=float(d["peak_flops"]),
                    mem_bw=float(d["mem_bw"]),
                    name=str(d.get("name", "calibrated")),
                    memory_bytes=None if memory is None else float(memory),
                    peak_flops_fp32=None if fp32 is None else float(fp32),
                    op_overhead_s=float(d.get("op_overhead_s") or 0.0),
                    optimizer_rate=None if rate is None else float(rate),
                    host_op_s=None if d.get("host_op_s") is None else float(d["host_op_s"]),
                )
            return cls(network, device, mesh, dict(data.get("details") or {}))
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"malformed profile ({type(err).__name__}: {err})") from None

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically (a temporary file renamed): a profile is either complete or absent."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_atomic(path, json.dumps(self.to_json(), indent=1) + "\n")


def read_profile(path: str | os.PathLike) -> ProfileFile:
    """Read a profile file; one clear ValueError naming the file if it cannot be used."""
    data = read_json(path, name=f"profile file {path}")
    try:
        return ProfileFile.from_json(data)
    except ValueError as err:
        raise ValueError(f"profile file {path}: {err}") from None


def _preset_or_file(preset, spec: str):
    """`preset(spec)` for a preset name; None when `spec` is no preset but looks like a path."""
    try:
        return preset(spec)
    except ValueError as err:
        if os.sep in spec or "/" in spec or spec.endswith(".json") or os.path.exists(spec):
            return None
        raise ValueError(f"{err}, or the path of a profile file written by `python -m autoshard calibrate`") from None


def network_profile(
    spec: NetworkProfile | str, mesh_shape: tuple[int, ...], intra_node_dims: Sequence[int] | None = None
) -> NetworkProfile:
    """A NetworkProfile from a profile, a preset name (`intra_node_dims` on the intra-node link;
    default the last dim), or a profile file measured on this mesh shape."""
    if isinstance(spec, NetworkProfile):
        return spec
    found = _preset_or_file(lambda name: NetworkProfile.preset(name, len(mesh_shape), intra_node_dims), spec)
    if found is not None:
        return found
    data = read_profile(spec)
    if data.network is None:
        raise ValueError(f"profile file {spec}: has no network profile (calibrate under torchrun with --mesh)")
    if tuple(mesh_shape) != data.mesh_shape:
        raise ValueError(
            f"profile file {spec}: measured on mesh {_mesh(data.mesh_shape)}, planning for mesh "
            f"{_mesh(mesh_shape)}; calibrate on this mesh shape"
        )
    return data.network


def device_profile(spec: DeviceProfile | str) -> DeviceProfile:
    """A DeviceProfile from a profile, a preset name, or a profile file."""
    if isinstance(spec, DeviceProfile):
        return spec
    found = _preset_or_file(DeviceProfile.preset, spec)
    if found is not None:
        return found
    data = read_profile(spec)
    if data.device is None:
        raise ValueError(f"profile file {spec}: has no device profile")
    return data.device


def _mesh(shape: Any) -> str:
    return "x".join(map(str, shape))
