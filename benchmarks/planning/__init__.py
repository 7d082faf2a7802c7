"""What planning costs and what it gives: planning time and peak memory, plan quality against
hand-written plans, the memory fit, the redistribute planner, the ILP solver, 3D meshes. Planning
runs on meta and fake tensors in one process: these benchmarks need no process group and model
GPU clusters on a CPU."""
