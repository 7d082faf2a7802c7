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


def assert_step_matches(pmodel: Any, mode: Any, loss: Any, want_loss: float, want_grads: dict, step: int) -> None:
    """Every rank's `loss` and every trained parameter's gradient (gathered whole) equal one
    device's at this step; a frozen parameter (absent from `want_grads`) has none. AdamW's steps
    turn reduction-order ulps into ~1e-7 weight differences: later steps get a 1e-5 floor."""
    import torch

    with mode.disable():
        for got in tc.rank_values(loss).values():
            assert abs(got.item() - want_loss) <= 1e-5 * max(1.0, abs(want_loss)), (step, got, want_loss)
    atol = 1e-6 if step == 0 else 1e-5
    for fqn, p in pmodel.named_parameters():
        if fqn not in want_grads:
            assert p.grad is None and not p.requires_grad, fqn
            continue
        full = p.grad.full_tensor()
        with mode.disable():
            for got in tc.rank_values(full).values():
                torch.testing.assert_close(
                    got, want_grads[fqn], rtol=1e-5, atol=atol, msg=lambda m, fqn=fqn: f"{fqn} step {step}: {m}"
                )
