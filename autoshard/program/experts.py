"""The experts ops (`autoshard_models.experts`) on one rank, under the strategy the plan chose.

Each rank's experts run as grouped GEMMs (torch's private kernel, through `_torch_compat`) where
this torch's kernel takes the operands, else one matmul per expert.

Without expert parallelism a rank runs the op's own math on its local tensors: its tokens, its
experts (`first` says which), its slice of their hidden width; what it leaves out is someone
else's partial sum. With it (experts and tokens split on the same mesh dims) a rank sends each
routed pair to the member of its group holding the pair's expert (all-to-all with the counts
exchanged first: one host read of the split sizes per op), runs the pairs it receives and sends
the results back. The backward sends the token and gradient rows again rather than keeping the
forward's received rows: less memory held between the passes, one more exchange.

Under a dry run's fake tensors nothing is routed: the outputs have the shapes the real op
gives, and the pair rows it holds at once under a balanced routing are allocated and dropped, so
the dry run counts them as transient memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from autoshard import _torch_compat as tc
from autoshard.layout import Layout
from autoshard.program.collectives import mesh_group
from autoshard.strategies.call import OpCall
from autoshard.strategies.rules.experts import EXPERTS, EXPERTS_BACKWARD, SLOTS, ExpertSplit, split_of
from autoshard_models.experts import LOOP, Grouped, experts_backward, experts_forward, rows_backward, rows_forward


def _mm(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return tc.grouped_mm(x, w, counts) if tc.grouped_mm_fits(x, w) else LOOP.mm(x, w, counts)


def _outer(x: torch.Tensor, y: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return tc.grouped_outer(x, y, counts) if tc.grouped_mm_fits(x, y) else LOOP.outer(x, y, counts)


# the experts' matmuls: one grouped GEMM each where this torch's kernel takes the operands
GROUPED = Grouped(_mm, _outer)


def local_experts(op: Any, inputs: Sequence[Layout | None], vals: Sequence[Any], mesh: Any) -> Any:
    """The call_function target that runs `op` (forward or backward) with these input layouts."""
    split = split_of(op, inputs, vals, tuple(mesh.shape))
    n_experts = vals[SLOTS[op][1]].shape[0]
    return (LocalExperts if op is EXPERTS else LocalExpertsBackward)(split, mesh, n_experts)


class _Routing:
    """This rank's routed pairs grouped by the group member holding their expert."""

    def __init__(self, experts: torch.Tensor, owner: torch.Tensor, name: str, n: int):
        k = experts.shape[1]
        flat = experts.reshape(-1)
        dest = owner[flat]
        kept = torch.nonzero(dest >= 0).squeeze(1)
        self.pairs = kept[torch.argsort(dest[kept], stable=True)]
        self.tokens = self.pairs // k
        self.ids = flat[self.pairs]
        sent = torch.bincount(dest[self.pairs], minlength=n)
        got = tc.all_to_all_now(sent, [1] * n, [1] * n, name)
        self.send, self.recv = sent.tolist(), got.tolist()  # the host read the exchange needs
        self.name = name

    def out(self, t: torch.Tensor) -> torch.Tensor:
        return tc.all_to_all_now(t.contiguous(), self.recv, self.send, self.name)

    def back(self, t: torch.Tensor) -> torch.Tensor:
        return tc.all_to_all_now(t.contiguous(), self.send, self.recv, self.name)


class LocalExperts:
    """`routed_experts(x, weights, experts, w1, w3, w2)` on local tensors."""

    def __init__(self, split: ExpertSplit, mesh: Any, n_experts: int):
        coord = mesh.get_coordinate()
        self.split, self.first = split, split.first(coord)
        self.__name__ = type(self).__name__
        self.name: str | None = None
        self.firsts: list[int] = []
        if split.parallel_dims:
            self.name = tc.group_name(mesh_group(mesh, split.parallel_dims))
            self.firsts = split.group_firsts(coord)
        self.n_experts = n_experts
        self._owner: torch.Tensor | None = None

    def owner(self, device: torch.device) -> torch.Tensor:
        """[n_experts]: the group rank holding each expert, -1 where no member does."""
        if self._owner is None or self._owner.device != device:
            owner = torch.full((self.n_experts,), -1, dtype=torch.int64)
            for j, first in enumerate(self.firsts):
                owner[first : first + self.split.local] = j
            self._owner = owner.to(device)
        return self._owner

    def routing(self, experts: torch.Tensor) -> _Routing:
        assert self.name is not None
        return _Routing(experts, self.owner(experts.device), self.name, len(self.firsts))

    def __call__(self, x, weights, experts, w1, w3, w2):
        if tc.fake_mode_of(x) is not None:
            self._transient(x, experts, rows_held=3)
            return torch.empty_like(x)
        if self.name is None:
            return experts_forward(x, weights, experts, w1, w3, w2, self.first, GROUPED)
        r = self.routing(experts)
        got = rows_forward(r.out(x[r.tokens]), r.out(r.ids), w1, w3, w2, self.first, GROUPED)
        back = r.back(got)
        scaled = back * weights.reshape(-1)[r.pairs, None].to(back.dtype)
        return torch.zeros_like(x).index_add_(0, r.tokens, scaled)

    def _transient(self, x: torch.Tensor, experts: torch.Tensor, rows_held: int) -> None:
        """The pair rows the op holds at once under a balanced routing (gathered or sent, received,
        computed: `rows_held` buffers of this rank's pairs), allocated and dropped."""
        pairs = experts.numel()
        if self.name is None:  # no exchange: only the pairs routed to this rank's experts
            pairs = pairs * self.split.local // self.n_experts
        held = x.new_empty(rows_held, pairs, x.shape[1])
        del held


class LocalExpertsBackward(LocalExperts):
    """`routed_experts_backward(grad, x, weights, experts, w1, w3, w2)` on local tensors."""

    def __call__(self, grad, x, weights, experts, w1, w3, w2):  # type: ignore[override]
        if tc.fake_mode_of(x) is not None:
            self._transient(x, experts, rows_held=6)
            return tuple(torch.empty_like(t) for t in (x, weights, w1, w3, w2))
        if self.name is None:
            return experts_backward(grad, x, weights, experts, w1, w3, w2, self.first, GROUPED)
        r = self.routing(experts)
        dim = x.shape[1]
        rows = r.out(torch.cat([x[r.tokens], grad[r.tokens]], dim=1))
        ids, pair_weights = r.out(r.ids), r.out(weights.reshape(-1)[r.pairs])
        got_x, got_grad = rows[:, :dim], rows[:, dim:]
        g_rows, g1, g3, g2, out = rows_backward(
            got_grad * pair_weights[:, None].to(got_grad.dtype), got_x, ids, w1, w3, w2, self.first, GROUPED
        )
        g_x = r.back(g_rows)
        g_pair = r.back((out * got_grad).sum(-1).to(weights.dtype))
        grad_x = torch.zeros_like(x).index_add_(0, r.tokens, g_x)
        grad_weights = torch.zeros(weights.numel(), dtype=weights.dtype, device=weights.device)
        grad_weights[r.pairs] = g_pair
        return grad_x, grad_weights.view_as(weights), g1, g3, g2


REGIONS = {EXPERTS: local_experts, EXPERTS_BACKWARD: local_experts}


def prepare_expert_groups(plan: Any, mesh: Any) -> None:
    """Make the flattened groups the plan's expert-parallel ops exchange over, now, in one order
    on every rank (as `collectives.prepare_groups` does for redistributions)."""
    needed = set()
    for node in plan.graph.nodes:
        if node.op == "call_function" and node.target in REGIONS:
            inputs = plan.strategies[node.name].inputs
            dims = split_of(node.target, inputs, OpCall(node, plan.mesh_shape).in_vals, plan.mesh_shape).parallel_dims
            if len(dims) > 1:
                needed.add(dims)
    for dims in sorted(needed):
        mesh_group(mesh, dims)
