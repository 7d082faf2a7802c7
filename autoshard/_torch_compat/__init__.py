"""The one place autoshard touches private torch APIs (torch 2.11 through 2.14).

Everything here may move between torch releases; keeping it in one package means one place to fix,
and one module per torch subsystem an upgrade can break:

- `dtensor`: specs, placements and the shard order, DTensors from local shards, torch's own
  redistribute planner, the strategy registry;
- `collectives`: process groups, flattened meshes, the functional collectives the executor runs;
- `simulation`: many ranks in one process (LocalTensorMode, the fake process group);
- `tracing`: fake tensors, dynamo capture, the joint export and its descriptors, FX, pytree,
  nn.Module's private state;
- `ops`: op overloads and their schemas;
- `runtime`: dispatch modes, the dry run's fake tensors and memory tracker, torch.compile's and
  inductor's state, the SDPA kernel choice;
- `checkpoint`: DCP's reader and planner without their unrestricted unpicklers;
- `optim`: torch's AdamW stepped, and gradients clipped, on DTensors' local shards;
- `legacy`: what torch 2.11 and 2.12 lack, made up for.

The code reads as for torch 2.13 and 2.14; the module that defines a name picks its 2.11/2.12
variant from `legacy` when it is imported. Every name below has that one binding: this module only
re-exports them (tests/test_torch_compat.py checks it), and every caller imports this package alone
(`from autoshard import _torch_compat as tc`).
"""

from autoshard._torch_compat.checkpoint import (
    dcp_planner as dcp_planner,
)
from autoshard._torch_compat.checkpoint import (
    dcp_reader as dcp_reader,
)
from autoshard._torch_compat.collectives import (
    WAIT_TENSOR as WAIT_TENSOR,
)
from autoshard._torch_compat.collectives import (
    all_gather_launch as all_gather_launch,
)
from autoshard._torch_compat.collectives import (
    all_gather_now as all_gather_now,
)
from autoshard._torch_compat.collectives import (
    all_gather_single as all_gather_single,
)
from autoshard._torch_compat.collectives import (
    all_reduce_now as all_reduce_now,
)
from autoshard._torch_compat.collectives import (
    all_reduce_owned as all_reduce_owned,
)
from autoshard._torch_compat.collectives import (
    all_to_all_now as all_to_all_now,
)
from autoshard._torch_compat.collectives import (
    chunk_cat as chunk_cat,
)
from autoshard._torch_compat.collectives import (
    flattened_mesh as flattened_mesh,
)
from autoshard._torch_compat.collectives import (
    funcol as funcol,
)
from autoshard._torch_compat.collectives import (
    group_name as group_name,
)
from autoshard._torch_compat.collectives import (
    group_size as group_size,
)
from autoshard._torch_compat.collectives import (
    reduce_scatter_launch as reduce_scatter_launch,
)
from autoshard._torch_compat.collectives import (
    reduce_scatter_now as reduce_scatter_now,
)
from autoshard._torch_compat.collectives import (
    reduce_scatter_single as reduce_scatter_single,
)
from autoshard._torch_compat.collectives import (
    wait as wait,
)
from autoshard._torch_compat.collectives import (
    wait_launched as wait_launched,
)
from autoshard._torch_compat.dtensor import (
    DTensorSpec as DTensorSpec,
)
from autoshard._torch_compat.dtensor import (
    OpSchema as OpSchema,
)
from autoshard._torch_compat.dtensor import (
    OpSpec as OpSpec,
)
from autoshard._torch_compat.dtensor import (
    OpStrategy as OpStrategy,
)
from autoshard._torch_compat.dtensor import (
    Partial as Partial,
)
from autoshard._torch_compat.dtensor import (
    Replicate as Replicate,
)
from autoshard._torch_compat.dtensor import (
    Shard as Shard,
)
from autoshard._torch_compat.dtensor import (
    ShardOrderEntry as ShardOrderEntry,
)
from autoshard._torch_compat.dtensor import (
    TensorMeta as TensorMeta,
)
from autoshard._torch_compat.dtensor import (
    TupleStrategy as TupleStrategy,
)
from autoshard._torch_compat.dtensor import (
    _StridedShard as _StridedShard,
)
from autoshard._torch_compat.dtensor import (
    distribute_local as distribute_local,
)
from autoshard._torch_compat.dtensor import (
    dtensor_from_local as dtensor_from_local,
)
from autoshard._torch_compat.dtensor import (
    dtensor_like as dtensor_like,
)
from autoshard._torch_compat.dtensor import (
    local_of as local_of,
)
from autoshard._torch_compat.dtensor import (
    no_redistribute_costs as no_redistribute_costs,
)
from autoshard._torch_compat.dtensor import (
    registry_entry as registry_entry,
)
from autoshard._torch_compat.dtensor import (
    single_dim_rules as single_dim_rules,
)
from autoshard._torch_compat.dtensor import (
    spec_to_order as spec_to_order,
)
from autoshard._torch_compat.dtensor import (
    strategy_mesh as strategy_mesh,
)
from autoshard._torch_compat.dtensor import (
    strided_placements as strided_placements,
)
from autoshard._torch_compat.dtensor import (
    tensor_meta as tensor_meta,
)
from autoshard._torch_compat.dtensor import (
    torch_redistribute_steps as torch_redistribute_steps,
)
from autoshard._torch_compat.ops import (
    call_arguments as call_arguments,
)
from autoshard._torch_compat.ops import (
    grouped_mm as grouped_mm,
)
from autoshard._torch_compat.ops import (
    grouped_mm_fits as grouped_mm_fits,
)
from autoshard._torch_compat.ops import (
    grouped_outer as grouped_outer,
)
from autoshard._torch_compat.ops import (
    is_op_overload as is_op_overload,
)
from autoshard._torch_compat.ops import (
    op_call as op_call,
)
from autoshard._torch_compat.ops import (
    returns_alias as returns_alias,
)
from autoshard._torch_compat.ops import (
    shares_input_storage as shares_input_storage,
)
from autoshard._torch_compat.optim import (
    ShardwiseAdamW as ShardwiseAdamW,
)
from autoshard._torch_compat.optim import (
    clip_shards_ as clip_shards_,
)
from autoshard._torch_compat.pipelining import (
    Order as Order,
)
from autoshard._torch_compat.pipelining import (
    schedule_order as schedule_order,
)
from autoshard._torch_compat.runtime import (
    DispatchMode as DispatchMode,
)
from autoshard._torch_compat.runtime import (
    TorchDispatchMode as TorchDispatchMode,
)
from autoshard._torch_compat.runtime import (
    dispatch_mode_blocks_compile as dispatch_mode_blocks_compile,
)
from autoshard._torch_compat.runtime import (
    dynamo_counts as dynamo_counts,
)
from autoshard._torch_compat.runtime import (
    fake_mode_of as fake_mode_of,
)
from autoshard._torch_compat.runtime import (
    inductor_unavailable as inductor_unavailable,
)
from autoshard._torch_compat.runtime import (
    make_fake_tensors as make_fake_tensors,
)
from autoshard._torch_compat.runtime import (
    mem_tracker as mem_tracker,
)
from autoshard._torch_compat.runtime import (
    no_dispatch_modes as no_dispatch_modes,
)
from autoshard._torch_compat.runtime import (
    sdpa_backend as sdpa_backend,
)
from autoshard._torch_compat.runtime import (
    tracker_total as tracker_total,
)
from autoshard._torch_compat.simulation import (
    LocalTensor as LocalTensor,
)
from autoshard._torch_compat.simulation import (
    fake_process_group as fake_process_group,
)
from autoshard._torch_compat.simulation import (
    local_tensor as local_tensor,
)
from autoshard._torch_compat.simulation import (
    local_tensor_mode as local_tensor_mode,
)
from autoshard._torch_compat.simulation import (
    per_rank as per_rank,
)
from autoshard._torch_compat.simulation import (
    rank_values as rank_values,
)
from autoshard._torch_compat.tracing import (
    describe_input as describe_input,
)
from autoshard._torch_compat.tracing import (
    describe_output as describe_output,
)
from autoshard._torch_compat.tracing import (
    dynamo_capture as dynamo_capture,
)
from autoshard._torch_compat.tracing import (
    export_joint as export_joint,
)
from autoshard._torch_compat.tracing import (
    lazy_graph_module as lazy_graph_module,
)
from autoshard._torch_compat.tracing import (
    new_fake_mode as new_fake_mode,
)
from autoshard._torch_compat.tracing import (
    non_persistent_buffer_names as non_persistent_buffer_names,
)
from autoshard._torch_compat.tracing import (
    observed_user_error as observed_user_error,
)
from autoshard._torch_compat.tracing import (
    tree_flatten as tree_flatten,
)
from autoshard._torch_compat.tracing import (
    tree_leaves as tree_leaves,
)
from autoshard._torch_compat.tracing import (
    tree_unflatten as tree_unflatten,
)
from autoshard._torch_compat.tracing import (
    truncated_module_list as truncated_module_list,
)
from autoshard._torch_compat.tracing import (
    write_code as write_code,
)
