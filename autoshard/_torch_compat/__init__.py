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
- `legacy`: what torch 2.11 and 2.12 lack, made up for.

The code reads as for torch 2.13 and 2.14; the module that defines a name picks its 2.11/2.12
variant from `legacy` when it is imported. Every name below has that one binding: this module only
re-exports them (tests/test_torch_compat.py checks it), and every caller imports this package alone
(`from autoshard import _torch_compat as tc`).
"""

from autoshard._torch_compat.checkpoint import (
    dcp_planner as dcp_planner,
    dcp_reader as dcp_reader,
)
from autoshard._torch_compat.collectives import (
    WAIT_TENSOR as WAIT_TENSOR,
    all_gather_launch as all_gather_launch,
    all_gather_now as all_gather_now,
    all_gather_single as all_gather_single,
    all_reduce_now as all_reduce_now,
    all_reduce_owned as all_reduce_owned,
    all_to_all_now as all_to_all_now,
    flattened_mesh as flattened_mesh,
    funcol as funcol,
    group_name as group_name,
    group_size as group_size,
    reduce_scatter_launch as reduce_scatter_launch,
    reduce_scatter_now as reduce_scatter_now,
    reduce_scatter_single as reduce_scatter_single,
    wait as wait,
)
from autoshard._torch_compat.dtensor import (
    DTensorSpec as DTensorSpec,
    OpSchema as OpSchema,
    OpSpec as OpSpec,
    OpStrategy as OpStrategy,
    Partial as Partial,
    Replicate as Replicate,
    Shard as Shard,
    ShardOrderEntry as ShardOrderEntry,
    TensorMeta as TensorMeta,
    TupleStrategy as TupleStrategy,
    _StridedShard as _StridedShard,
    distribute_local as distribute_local,
    dtensor_from_local as dtensor_from_local,
    dtensor_like as dtensor_like,
    local_of as local_of,
    no_redistribute_costs as no_redistribute_costs,
    registry_entry as registry_entry,
    single_dim_rules as single_dim_rules,
    spec_to_order as spec_to_order,
    strategy_mesh as strategy_mesh,
    strided_placements as strided_placements,
    tensor_meta as tensor_meta,
    torch_redistribute_steps as torch_redistribute_steps,
)
from autoshard._torch_compat.ops import (
    call_arguments as call_arguments,
    is_op_overload as is_op_overload,
    op_call as op_call,
    returns_alias as returns_alias,
    shares_input_storage as shares_input_storage,
)
from autoshard._torch_compat.runtime import (
    DispatchMode as DispatchMode,
    TorchDispatchMode as TorchDispatchMode,
    dispatch_mode_blocks_compile as dispatch_mode_blocks_compile,
    dynamo_counts as dynamo_counts,
    fake_mode_of as fake_mode_of,
    inductor_unavailable as inductor_unavailable,
    make_fake_tensors as make_fake_tensors,
    mem_tracker as mem_tracker,
    no_dispatch_modes as no_dispatch_modes,
    sdpa_backend as sdpa_backend,
    tracker_total as tracker_total,
)
from autoshard._torch_compat.simulation import (
    LocalTensor as LocalTensor,
    fake_process_group as fake_process_group,
    local_tensor as local_tensor,
    local_tensor_mode as local_tensor_mode,
    per_rank as per_rank,
    rank_values as rank_values,
)
from autoshard._torch_compat.tracing import (
    describe_input as describe_input,
    describe_output as describe_output,
    dynamo_capture as dynamo_capture,
    export_joint as export_joint,
    lazy_graph_module as lazy_graph_module,
    new_fake_mode as new_fake_mode,
    non_persistent_buffer_names as non_persistent_buffer_names,
    observed_user_error as observed_user_error,
    tree_flatten as tree_flatten,
    tree_leaves as tree_leaves,
    tree_unflatten as tree_unflatten,
    truncated_module_list as truncated_module_list,
    write_code as write_code,
)
