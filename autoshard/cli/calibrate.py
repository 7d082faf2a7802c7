"""`python -m autoshard calibrate`: measure this cluster's network and device, write a profile file.

    torchrun --standalone --nproc_per_node=4 -m autoshard calibrate --mesh 2x2 --out profile.json
    python -m autoshard calibrate --out device.json          # one process: the device part only

Under torchrun every rank times all_gather, reduce_scatter, all_reduce and all_to_all on each mesh
dim and on each flattened group of mesh dims the planner uses (`profiles.calibrate`), back to back
and (the smallest all-reduce) between matmuls, as a step issues them; then matmuls and an
elementwise add per dtype, and the ops of a small llama's training step each clocked inside it
(`time_reference_step`), all ranks at once; rank 0 fits the planner's
parameters (`pricing.fit`) and writes the file, which `plan` and `train` take as `--network FILE`
and `--device FILE` (and the API as `AutoShard(network=FILE, device=FILE)`). Calibrate once per
cluster and mesh shape; the file records how it was measured and how well the model fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Sequence

from autoshard.cli.args import RaisingArgumentParser, add_option, arg_type
from autoshard.cli.calibrate_device import fit_device_profile, time_reference_step
from autoshard.driver.config import mesh_names
from autoshard.options import OUT, UsageError, name_list, parse_bytes, parse_mesh, positive_int

KIB, MIB = 2**10, 2**20


def calibrate_parser(prog: str = "python -m autoshard calibrate") -> argparse.ArgumentParser:
    p = RaisingArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--mesh",
        type=arg_type(parse_mesh),
        default=None,
        help="mesh shape to calibrate, e.g. 2x2 (default: all ranks in one dim; its product must be the world size)",
    )
    p.add_argument(
        "--mesh-names",
        type=arg_type(name_list),
        default=None,
        help="mesh dim roles, e.g. dp,tp (default: dp; dp,tp; dp_replicate,dp_shard,tp for 1, 2, 3 dims)",
    )
    add_option(p, OUT, default="profile.json", help="profile file to write (default profile.json)")
    p.add_argument(
        "--min-size",
        type=arg_type(parse_bytes),
        default=4 * KIB,
        metavar="BYTES",
        help="smallest collective, local input bytes (default 4KiB)",
    )
    p.add_argument(
        "--max-size",
        type=arg_type(parse_bytes),
        default=32 * MIB,
        metavar="BYTES",
        help="largest collective, local input bytes (default 32MiB); sizes grow 4x from --min-size",
    )
    p.add_argument(
        "--repeats",
        type=arg_type(positive_int),
        default=7,
        help="timed calls per size (default 7; sizes above 4 MiB get 3), after 2 warm-up calls",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test: collectives up to 1 MiB, small matmuls, 2 calls each (a usable but rough profile)",
    )
    return p


def _settings(a: argparse.Namespace):
    from autoshard.profiles.calibrate import CalibrationSettings

    if a.min_size > a.max_size:
        raise UsageError(f"--min-size {a.min_size:g} is larger than --max-size {a.max_size:g}")
    if a.quick:
        a.max_size = min(a.max_size, MIB)
        a.min_size = min(a.min_size, a.max_size)
    sizes = []
    size = int(a.min_size)
    while size < a.max_size:
        sizes.append(size)
        size *= 4
    sizes.append(int(a.max_size))
    if len(sizes) < 2:
        raise UsageError("--min-size and --max-size must differ: the fit needs two sizes or more")
    if a.quick:
        return CalibrationSettings(
            sizes=tuple(sizes),
            warmup=1,
            repeats=2,
            big_repeats=2,
            matmul_sizes=(32, 64, 128),
            memory_sizes=(16 * KIB, 64 * KIB, 256 * KIB),
            optimizer_sizes=(2**14, 2**17, 2**20),
            min_seconds=0.02,
            between_matmul=64,
            between_calls=5,
            between_rounds=1,
        )
    return CalibrationSettings(sizes=tuple(sizes), repeats=a.repeats, big_repeats=min(3, a.repeats))


def _init(a: argparse.Namespace):
    """The process group (gloo on CPU, nccl on GPUs; a world of 1 without torchrun), the mesh
    (None in a world of 1) and the device."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.driver.processes import start_process_group

    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh_shape = a.mesh if a.mesh is not None else (world,)
    if math.prod(mesh_shape) != world:
        hint = f"torchrun --nproc_per_node={math.prod(mesh_shape)}" if world == 1 else f"the world size is {world}"
        raise UsageError(
            f"mesh {'x'.join(map(str, mesh_shape))} has {math.prod(mesh_shape)} ranks: the network "
            f"is measured with that many processes ({hint})"
        )
    try:
        names = mesh_names(a.mesh_names, mesh_shape)
    except ValueError as err:
        raise UsageError(str(err)) from None
    kind = start_process_group()
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device.type, mesh_shape, mesh_dim_names=names) if world > 1 else None
    return mesh, mesh_shape, names, device


def _median_rows(per_rank: list[dict]) -> dict:
    """Timings of every rank ({key: {part: rows}}) -> one set: each timed field of each sample
    (`seconds`, `..._s`) the median over ranks."""
    out: dict = {}
    for key, parts in per_rank[0].items():
        out[key] = {
            part: [
                dict(
                    row,
                    **{
                        f: statistics.median(r[key][part][i][f] for r in per_rank)
                        for f in row
                        if f == "seconds" or f.endswith("_s")
                    },
                )
                for i, row in enumerate(rows)
            ]
            for part, rows in parts.items()
        }
    return out


RETIMES = 2


def _collective_samples(mesh: Any, mesh_shape: tuple[int, ...], settings: Any, say: Callable[[str], None]) -> list:
    """Collective timings on every rank; a group whose timings do not grow with the bytes (a
    burst of load from elsewhere) is timed again, up to RETIMES times, before the fit refuses it.
    Every rank holds the same timings, so every rank makes the same choice."""
    from autoshard.pricing.fit import FlatTimings, fit_network
    from autoshard.profiles.calibrate import time_collectives

    samples = time_collectives(mesh, settings, say)
    for _ in range(RETIMES):
        try:
            fit_network([_sample(s) for s in samples], mesh_shape, mem_bw=1.0)
            return samples
        except FlatTimings as flat:
            say(
                f"note: timings of group(s) {list(flat.groups)} do not grow with the bytes "
                "(a busy machine?): timing again"
            )
            again = time_collectives(mesh, settings, say, only=flat.groups)
            samples = [s for s in samples if tuple(s["mesh_dims"]) not in flat.groups] + again
        except ValueError:  # another fault: the fit below reports it
            return samples
    return samples


def _device_timings(device: Any, settings: Any, say: Callable[[str], None], gather: Callable[[Any], list]) -> dict:
    """The device's timings, each the median over ranks (`gather`: this rank's -> every rank's).
    While a dtype's matmuls or memory ops do not grow with the work (a burst of load on the quick
    run's small sizes), they are timed again, up to RETIMES times; then the fit refuses them.
    Every rank holds every rank's timings, so every rank makes the same choice."""
    from autoshard.profiles.calibrate import time_device

    timings = _median_rows(gather(time_device(device, settings, say)))
    for _ in range(RETIMES):
        flat = _flat_rates(timings)
        if not flat:
            break
        say(f"note: timings of {', '.join(flat)} do not grow with the work (a busy machine?): timing again")
        timings = _median_rows(gather(time_device(device, settings, say)))
    return timings


def _flat_rates(timings: dict) -> list[str]:
    """Which of the device timings ({dtype: {part: rows}}) no rate fits: 'float32 matmul', ..."""
    from autoshard.pricing.fit import fit_rate

    flat = []
    for dtype, parts in timings.items():
        for part, work in (("matmul", "flops"), ("memory", "bytes")):
            try:
                fit_rate([r[work] for r in parts[part]], [r["seconds"] for r in parts[part]])
            except ValueError:
                flat.append(f"{dtype} {part}")
    return flat


def _sample(row: dict) -> Any:
    from autoshard.pricing.fit import CollectiveSample

    return CollectiveSample(row["kind"], tuple(row["mesh_dims"]), row["group_size"], row["in_bytes"], row["seconds"])


def calibrate(a: argparse.Namespace) -> int:
    import torch.distributed as dist
    from torch import __version__ as torch_version

    from autoshard.profiles.files import ProfileFile

    settings = _settings(a)
    mesh, mesh_shape, names, device = _init(a)
    rank, world = dist.get_rank(), dist.get_world_size()
    start = time.perf_counter()

    def say(line: str) -> None:
        if rank == 0:
            print(f"[calibrate {time.perf_counter() - start:5.1f}s] {line}", flush=True)

    say(
        f"{world} rank(s) on {device.type}, mesh {'x'.join(map(str, mesh_shape))} ({','.join(names)}), "
        f"torch {torch_version}"
    )
    samples, between, timings, per_rank = _measure(mesh, mesh_shape, device, settings, say)
    if rank != 0:
        return 0
    host = platform.node() or "host"
    fitted = _fit(timings, _median_rows(per_rank)["step"], samples, between, device, mesh_shape, host)
    details = {
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": host,
        "torch": torch_version,
        "backend": dist.get_backend(),
        "device_type": device.type,
        "world_size": world,
        "mesh_names": list(names),
        "ranks_timed_at_once": world,
        "seconds": round(time.perf_counter() - start, 1),
        "settings": {
            "sizes": list(settings.sizes),
            "warmup": settings.warmup,
            "repeats": settings.repeats,
            "big_repeats": settings.big_repeats,
        },
        "device": fitted.by_dtype,
        "step": fitted.step,
    }
    if fitted.fit is not None:
        details |= _network_details(fitted, samples, between)
    network = fitted.network
    try:
        path = ProfileFile(network, fitted.device, tuple(mesh_shape) if network is not None else None, details).save(
            a.out
        )
    except OSError as err:
        raise UsageError(f"cannot write the profile to {a.out}: {err}") from None
    for line in summary_lines(network, fitted.fit, fitted.by_dtype, fitted.step):
        say(line)
    use = ([f"--network {path}"] if network is not None else []) + [f"--device {path}"]
    say(f"wrote {path} in {time.perf_counter() - start:.1f} s; plan or train with {' '.join(use)}")
    return 0


def _measure(mesh: Any, mesh_shape: tuple[int, ...], device: Any, settings: Any, say: Callable[[str], None]):
    """Every rank times, all at once: the collectives back to back and between compute (with a
    mesh), the device's ops, and a training step's parts. Returns the collective samples and
    those between compute (this rank's), the device timings (the median over ranks) and every
    rank's step timings."""
    import torch.distributed as dist

    from autoshard.profiles.calibrate import time_collectives_between_compute, time_step_parts

    samples = _collective_samples(mesh, mesh_shape, settings, say) if mesh is not None else []
    between = time_collectives_between_compute(mesh, settings, say) if mesh is not None else []
    parts = time_step_parts(device, settings, say)
    parts["reference"] = time_reference_step(device, settings, say)

    def gather(mine: Any) -> list:
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
        return per_rank

    timings = _device_timings(device, settings, say, gather)
    return samples, between, timings, gather({"step": parts})


@dataclasses.dataclass
class _Fitted:
    """What rank 0 fits to the timings: the device profile with its details per dtype and of the
    step's parts, and with a mesh the network profile (launch time between compute included),
    the back-to-back fit it comes from and the launch time compute adds."""

    device: Any
    by_dtype: dict
    step: dict
    network: Any = None
    fit: Any = None
    extra_s: float = 0.0


def _fit(
    timings: dict, step: dict, samples: list, between: list, device: Any, mesh_shape: tuple[int, ...], host: str
) -> _Fitted:
    """The profiles the timings fit; UsageError when they are too noisy to fit (the measurement's
    fault, not a bug). Each collective sample gets the back-to-back fit's price (`model_s`)."""
    from autoshard.pricing.fit import BetweenCompute, between_compute_s, fit_network

    try:
        fitted = _Fitted(*fit_device_profile(timings, step, device, f"calibrated {device.type} ({host})"))
        if samples:
            fitted.fit = fit_network(
                [_sample(s) for s in samples],
                mesh_shape,
                fitted.device.mem_bw,
                name=f"calibrated {'x'.join(map(str, mesh_shape))} ({host})",
            )
    except ValueError as err:
        raise UsageError(
            f"the timings cannot be fit to a profile ({err}); calibrate again on an idle machine"
        ) from None
    fit = fitted.fit
    if fit is not None:
        fitted.extra_s = between_compute_s(
            fit,
            [
                BetweenCompute(
                    b["kind"], tuple(b["mesh_dims"]), b["group_size"], b["in_bytes"], b["work_s"], b["both_s"]
                )
                for b in between
            ],
        )
        fitted.network = dataclasses.replace(fit.profile, launch_s=fit.profile.launch_s + fitted.extra_s)
        for s in samples:  # the back-to-back fit's price: what the fit error is measured on
            s["model_s"] = fit.model_s(_sample(s))
    return fitted


def _network_details(fitted: _Fitted, samples: list, between: list) -> dict:
    """The profile file's record of the network fit: its error per group, the samples, and the
    launch time between compute."""
    fit = fitted.fit
    return {
        "network_fit": {
            "rel_rms": fit.rel_rms,
            "groups": [
                {
                    "mesh_dims": list(g.mesh_dims),
                    "group_size": g.group_size,
                    "alpha": g.alpha,
                    "beta": g.beta,
                    "rel_rms": g.rel_rms,
                    "max_rel_err": g.max_rel_err,
                    "samples": g.samples,
                    "rel_rms_by_kind": g.rel_rms_by_kind,
                    "one_link_rel_rms": g.group_rel_rms,
                }
                for g in fit.groups
            ],
        },
        "collectives": samples,
        "between_compute": {
            "launch_back_to_back_s": fit.profile.launch_s,
            "extra_s": fitted.extra_s,
            "timings": between,
        },
    }


def summary_lines(network, fit, by_dtype: dict, step: dict) -> list[str]:
    lines = []
    if network is not None and fit is not None:
        lines.append(
            f"network: launch {network.launch_s * 1e6:.1f} us per collective ({fit.profile.launch_s * 1e6:.1f} "
            f"back to back, +{(network.launch_s - fit.profile.launch_s) * 1e6:.1f} between compute); "
            f"fit error {fit.rel_rms:.1%} rms over all samples"
        )
        for g in fit.groups:
            lines.append(
                f"  mesh dims {list(g.mesh_dims)} ({g.group_size} ranks): alpha {g.alpha * 1e6:.1f} us, "
                f"beta {g.beta / 1e9:.3f} GB/s (one link: fit error {g.group_rel_rms:.1%} rms); per kind "
                f"{g.rel_rms:.1%} rms, max {g.max_rel_err:.0%}:"
            )
            for kind, dims, alpha, beta in network.kinds:
                if dims == g.mesh_dims:
                    lines.append(
                        f"    {kind}: alpha {alpha * 1e6:.1f} us, beta {beta / 1e9:.3f} GB/s, fit error "
                        f"{g.rel_rms_by_kind.get(kind, 0.0):.0%} rms"
                    )
    if step.get("in_step"):
        lines.append(
            f"device: inside a training step matmuls and attention ran at {step['in_step']['fp32_flops'] / 1e9:.2f} "
            f"GFLOP/s (alone {step['alone']['fp32_flops'] / 1e9:.2f}), memory-bound ops at "
            f"{step['in_step']['mem_bw'] / 1e9:.2f} GB/s (a streaming add {step['alone']['mem_bw'] / 1e9:.2f}); "
            "the profile keeps the rates inside the step"
        )
    lines.append(
        f"device: {step['op_dispatch_s'] * 1e6:.1f} us per op dispatched; fused AdamW "
        f"{step['optimizer_rate'] / 1e6:.0f}M parameter elements/s (+{step['optimizer_overhead_s'] * 1e6:.0f} us "
        f"per step)"
    )
    for dtype, d in by_dtype.items():
        lines.append(
            f"device {dtype}: matmul {d['matmul_flops'] / 1e9:.2f} GFLOP/s (+{d['matmul_overhead_s'] * 1e6:.0f} "
            f"us per call), memory {d['mem_bw'] / 1e9:.2f} GB/s (+{d['mem_overhead_s'] * 1e6:.0f} us per call)"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    import torch.distributed as dist

    try:
        return calibrate(calibrate_parser().parse_args(argv))
    except UsageError as err:  # bad input, a fit that cannot be made; any other error is a bug: its traceback
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
