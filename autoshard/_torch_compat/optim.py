"""Optimizers stepped on DTensors' local shards: torch's own AdamW (its state, its checkpoints,
its fused kernel), with the step's lists unwrapped before the kernel runs. Uses the optimizer's
private `_init_group` (the same signature in torch 2.11 through 2.14), and `_foreach_mul_` to
clip gradients' shards as `clip_grads_with_norm_` does."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam


def _local(values: list[torch.Tensor]) -> list[torch.Tensor]:
    return [v.to_local() if isinstance(v, DTensor) else v for v in values]  # under no_grad: the shard itself


class ShardwiseAdamW(torch.optim.AdamW):
    """torch's AdamW, its step run on each parameter's local shard when every gradient has its
    parameter's placements (autoshard's plans: a gradient lands in its parameter's layout). The
    kernel and the values are those DTensor's dispatch runs, so the update is the same bit for
    bit, without DTensor's propagation over every parameter, gradient and state tensor each step
    (a fused step over 57 DTensor parameters costs several times the kernel on a CPU host). The
    state stays DTensor, so checkpoints save and reshard as before."""

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch's signature)
        if closure is not None or any(
            isinstance(p, DTensor) and p.grad is not None and p.grad.placements != p.placements
            for group in self.param_groups
            for p in group["params"]
        ):
            return super().step(closure)
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
            has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
            beta1, beta2 = group["betas"]
            adam(
                _local(params),
                _local(grads),
                _local(exp_avgs),
                _local(exp_avg_sqs),
                _local(max_exp_avg_sqs),
                steps,
                amsgrad=group["amsgrad"],
                has_complex=has_complex,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
                foreach=group["foreach"],
                capturable=group["capturable"],
                differentiable=group["differentiable"],
                fused=group["fused"],
                grad_scale=getattr(self, "grad_scale", None),
                found_inf=getattr(self, "found_inf", None),
                decoupled_weight_decay=group["decoupled_weight_decay"],
            )
        return None


@torch.no_grad()
def clip_shards_(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """`clip_grads_with_norm_`'s scaling (the same factor, the same kernel) on each DTensor
    gradient's local shard, without DTensor's dispatch per gradient."""
    factor = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    torch._foreach_mul_(_local(grads), factor)
