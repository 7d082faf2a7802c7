"""Every rank of a mesh in this process, for tests: a fake process group, a named DeviceMesh and a
LocalTensorMode (the private torch pieces come from autoshard._torch_compat)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoshard import _torch_compat as tc


@contextlib.contextmanager
def simulated_mesh(mesh_shape: Sequence[int], names: Sequence[str] | None = None) -> Iterator[tuple[DeviceMesh, Any]]:
    """Yields (mesh, mode): tensors made inside hold one value per rank; use `mode.disable()` for
    code that must compute one global value (reference data, checks)."""
    shape = tuple(mesh_shape)
    names = tuple(names) if names is not None else tuple(f"m{i}" for i in range(len(shape)))
    with tc.fake_process_group(math.prod(shape)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        with tc.local_tensor_mode(math.prod(shape)) as mode:
            yield mesh, mode
