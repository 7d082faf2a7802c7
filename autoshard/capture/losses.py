"""A mean loss over targets some of which are ignored, made exact under a split batch.

`nll_loss_forward` with reduction 'mean' divides each rank's sum by that rank's count of counted
targets (those not `ignore_index`, weighted by the class weights). Averaging those per-rank means
(the `Partial(avg)` DTensor's rule gives it) is the global mean only when every rank counts the
same: padded or masked labels (a masked LM's, a fine-tuning set's) break that, and the loss comes
out biased. So the traced graph asks the kernel for the sum and divides by the total weight it
returns: a sum splits exactly (`Partial(sum)`), and the division waits for the global total, the
value the backward already needs (`nll_loss_backward` divides by it).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

aten = torch.ops.aten
MEAN, SUM = 1, 2  # torch's Reduction enum
ARGS = ("self", "target", "weight", "reduction", "ignore_index")  # nll_loss_forward's schema


def sum_then_divide(gm: fx.GraphModule) -> int:
    """Rewrite every mean `nll_loss_forward` of the joint graph into its sum divided by its total
    weight; the same value on one device (the kernel divides the same two numbers: all-ignored
    targets still give NaN). Returns how many were rewritten."""
    graph = gm.graph
    rewritten = 0
    for node in list(graph.find_nodes(op="call_function", target=aten.nll_loss_forward.default)):
        values = dict(zip(ARGS, node.args)) | dict(node.kwargs)
        if values.get("reduction") != MEAN:
            continue
        values["reduction"] = SUM
        node.args, node.kwargs = tuple(values[name] for name in ARGS), {}
        loss = _getitem(graph, node, 0)
        total = _getitem(graph, node, 1)
        with graph.inserting_before(max(loss, total, key=_position(graph)).next):
            # one node for the total the division and the backward read: its all-reduce runs once
            shared = graph.create_node("call_function", aten.detach.default, (total,), name="nll_loss_total")
            mean = graph.create_node("call_function", aten.div.Tensor, (loss, shared), name="nll_loss_mean")
        shared.meta, mean.meta = dict(total.meta), dict(loss.meta)
        total.replace_all_uses_with(shared, delete_user_cb=lambda user: user is not shared)
        loss.replace_all_uses_with(mean, delete_user_cb=lambda user: user is not mean)
        rewritten += 1
    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten


def _getitem(graph: fx.Graph, node: fx.Node, index: int) -> fx.Node:
    """The `getitem` reading output `index` of a multi-output node (made if the graph has none)."""
    for user in node.users:
        if user.target is operator.getitem and user.args[1] == index:
            return user
    with graph.inserting_after(node):
        item = graph.call_function(operator.getitem, (node, index))
    item.meta = dict(node.meta)
    if "val" in node.meta:
        item.meta["val"] = node.meta["val"][index]
    return item


def _position(graph: fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__
