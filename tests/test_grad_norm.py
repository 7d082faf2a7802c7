"""The gradient norm's work shared by the replicas: each shard counted by one rank of the world."""

from __future__ import annotations

import torch
from torch.distributed.tensor import distribute_tensor

from autoshard import _torch_compat as tc
from autoshard.train.optimizer import counted_here
from simulation import simulated_mesh


def test_each_shard_is_counted_by_one_rank_and_the_replicas_share_the_work():
    """On a (2,2) mesh, gradients replicated (seven of several sizes), sharded on either dim, on
    both, in either device order (`_StridedShard`) and unevenly: summed over the 4 ranks, the
    squares of the shards each rank counts are the whole gradients' sum of squares exactly
    (integer values: no rounding), and the replicated gradients spread over every rank, none
    holding more than the largest of them."""
    g = torch.Generator().manual_seed(0)
    replicated = [torch.randint(-3, 4, (n,), generator=g).double() for n in (64, 48, 40, 32, 16, 8, 8)]
    sharded = [torch.randint(-3, 4, shape, generator=g).double() for shape in [(8, 6), (5, 8), (4, 4), (4, 8), (7, 4)]]
    with simulated_mesh((2, 2)) as (mesh, mode):
        strided = tc.strided_placements(((1, (1, 0)),), (tc.Shard(1), tc.Shard(1)), (2, 2))
        placements = [(tc.Replicate(), tc.Replicate())] * len(replicated) + [
            (tc.Shard(0), tc.Shard(1)),
            (tc.Shard(0), tc.Replicate()),
            (tc.Replicate(), tc.Shard(0)),
            strided,
            (tc.Replicate(), tc.Shard(0)),  # 7 rows over 2: uneven
        ]
        full = replicated + sharded
        grads = [
            distribute_tensor(t, mesh, p, **({"src_data_rank": None} if p is strided else {}))
            for t, p in zip(full, placements)
        ]
        with mode.disable():
            total, loads = 0.0, []
            for rank in range(4):
                counted = counted_here(grads, (rank // 2, rank % 2))
                for grad, here in zip(grads, counted):
                    if here:
                        local = grad.to_local()
                        shard = tc.rank_values(local)[rank] if isinstance(local, tc.LocalTensor) else local
                        total += shard.pow(2).sum().item()
                loads.append(sum(t.numel() for t, here in zip(replicated, counted) if here))
    assert total == sum(t.pow(2).sum().item() for t in full)
    assert sum(loads) == sum(t.numel() for t in replicated) and min(loads) > 0 and max(loads) <= 64
