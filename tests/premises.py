"""Profiles that state a test's premise instead of leaning on a preset's current figures.

The CPU presets price a collective's launch at what it costs between compute on a shared 2-core
machine (about 1 ms), and a rank's compute at half a core. Tests whose point needs launches to be
a small part of the communication (how buckets share them, how much prefetching hides) plan
under `cheap_launches`, an idle core per rank with 0.3 ms launches."""

from __future__ import annotations

import dataclasses

from autoshard.profiles.device import DeviceProfile
from autoshard.profiles.network import NetworkProfile


def cheap_launches(mesh_shape: tuple[int, ...]) -> NetworkProfile:
    """The `cpu-gloo` links with 0.3 ms per collective launch."""
    preset = NetworkProfile.preset("cpu-gloo", len(mesh_shape))
    return dataclasses.replace(preset, launch_s=300e-6, name="cpu-gloo, 0.3 ms launches")


def idle_core() -> DeviceProfile:
    """The `cpu` device with a whole core per rank: 100 GFLOP/s."""
    preset = DeviceProfile.preset("cpu")
    return dataclasses.replace(preset, peak_flops=100e9, peak_flops_fp32=100e9, name="cpu, a core per rank")
