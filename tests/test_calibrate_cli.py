"""Profile files and the `autoshard calibrate` command: files round-trip and are accepted where
presets are, bad files are one clear error (API and CLI), and `autoshard calibrate` writes a device
profile in one process and, under torchrun, a profile the planner uses. The fits themselves:
tests/test_calibrate.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autoshard.__main__ import main as autoshard_main
from autoshard.pricing.planner import Planner
from autoshard.pricing.ring import linear_cost
from autoshard.profiles.calibrate import planner_groups
from autoshard.profiles.device import DeviceProfile
from autoshard.profiles.files import ProfileFile, device_profile, network_profile, read_profile
from autoshard.profiles.network import NetworkProfile
from test_calibrate import KINDS, TRUE
from torchrun import child_env, torchrun_command

ROOT = Path(__file__).resolve().parents[1]


def test_profile_file_round_trips(tmp_path):
    device = DeviceProfile(
        peak_flops=3.2e10,
        mem_bw=2.9e10,
        name="calibrated cpu",
        memory_bytes=8e9,
        op_overhead_s=8e-6,
        optimizer_rate=5e8,
        host_op_s=2.5e-5,
    )
    path = ProfileFile(TRUE, device, (2, 2), {"host": "x"}).save(tmp_path / "p.json")
    back = read_profile(path)
    assert back.network == TRUE and back.device == device and back.mesh_shape == (2, 2)
    kinds = NetworkProfile(
        TRUE.alpha,
        TRUE.beta,
        TRUE.launch_s,
        TRUE.mem_bw,
        groups=TRUE.groups,
        kinds=(("all_gather", (1, 0), 1e-4, 1e8),),
    )
    assert read_profile(ProfileFile(kinds, device, (2, 2)).save(tmp_path / "k.json")).network == kinds
    assert back.details == {"host": "x"}
    assert network_profile(str(path), (2, 2)) == TRUE and device_profile(str(path)) == device
    # the planner prices with the loaded profile exactly as with the original
    shape, src, dst = (64, 32), "S(0)S(0)[0,1]", "RR"
    assert Planner((2, 2), network_profile(str(path), (2, 2))).cost(src, dst, shape, 4) == Planner((2, 2), TRUE).cost(
        src, dst, shape, 4
    )
    device_only = read_profile(ProfileFile(device=device).save(tmp_path / "d.json"))
    assert device_only.network is None and device_only.device == device
    # a file written before the step's other costs were measured still loads: no overhead, the
    # optimizer at memory bandwidth
    old = json.loads((tmp_path / "d.json").read_text())
    del old["device"]["op_overhead_s"], old["device"]["optimizer_rate"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = device_profile(str(tmp_path / "old.json"))
    assert loaded.op_overhead_s == 0 and loaded.optimizer_rate is None and loaded.mem_bw == device.mem_bw
    assert network_profile("cpu-gloo", (2, 2)).name == "cpu-gloo" and device_profile("cpu").name == "cpu"


def bad_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    good = ProfileFile(TRUE, DeviceProfile(1e10, 1e10), (2, 2))
    (tmp_path / "corrupt.json").write_text('{"format": "autoshard-profile", ')
    (tmp_path / "other.json").write_text(json.dumps({"fingerprint": "abc"}))
    broken = good.to_json()
    del broken["network"]["beta"]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    return {
        "missing": (tmp_path / "missing.json", "no such file"),
        "corrupt": (tmp_path / "corrupt.json", "not JSON"),
        "other": (tmp_path / "other.json", "not an autoshard profile"),
        "broken": (tmp_path / "broken.json", "malformed profile"),
        "mesh": (good.save(tmp_path / "2x2.json"), "measured on mesh 2x2, planning for mesh 4x2"),
        "device only": (
            ProfileFile(device=DeviceProfile(1e10, 1e10)).save(tmp_path / "d.json"),
            "has no network profile",
        ),
    }


def test_bad_profile_files_are_one_clear_error(tmp_path):
    from autoshard.driver.api import AutoShard
    from autoshard_models import build_model, get_config

    model = build_model(get_config("llama3-tiny"), device="meta")
    for what, (path, message) in bad_files(tmp_path).items():
        with pytest.raises(ValueError, match=message) as err:
            AutoShard(model, lambda: (), (4, 2), network=str(path), device="cpu")
        assert str(path) in str(err.value) and "\n" not in str(err.value), what
    with pytest.raises(ValueError, match="not JSON"):
        device_profile(str(tmp_path / "corrupt.json"))
    with pytest.raises(ValueError, match="unknown network profile 'nope'.*or the path of a profile file"):
        network_profile("nope", (2, 2))


def test_cli_refuses_bad_profile_files(tmp_path, capsys):
    files = bad_files(tmp_path)
    plan = [
        "plan",
        "--model",
        "llama3-tiny",
        "--batch",
        "8",
        "--seq",
        "16",
        "--no-dry-run",
        "--out",
        str(tmp_path / "o"),
    ]
    with pytest.raises(SystemExit) as done:
        autoshard_main([*plan, "--mesh", "4x2", "--network", str(files["mesh"][0])])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: profile file") and "planning for mesh 4x2" in err and "\n" not in err
    with pytest.raises(SystemExit):
        autoshard_main([*plan, "--mesh", "2x2", "--device", str(files["corrupt"][0])])
    assert capsys.readouterr().err.strip().startswith("error: profile file") and not (tmp_path / "o").exists()
    # train checks before it makes a process group: one line, exit 2
    code = autoshard_main(
        [
            "train",
            "--model",
            "llama3-tiny",
            "--mesh",
            "1",
            "--batch",
            "8",
            "--seq",
            "16",
            "--device",
            str(files["missing"][0]),
            "--out",
            str(tmp_path / "t"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"error: profile file {files['missing'][0]}: no such file"


def _run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = child_env()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


@pytest.mark.slow
def test_single_process_calibrate_writes_a_device_profile(tmp_path):
    out = _run([sys.executable, "-m", "autoshard", "calibrate", "--quick", "--out", str(tmp_path / "d.json")])
    assert "device cpu float32: matmul" in out.stdout and "wrote" in out.stdout
    data = read_profile(tmp_path / "d.json")
    assert data.network is None and data.device.peak_flops > 1e8 and data.device.mem_bw > 1e8
    assert set(data.details["device"]) == {"float32", "bfloat16"}
    assert 0 < data.device.op_overhead_s < 1e-3 and data.device.optimizer_rate > 1e6  # a step's other costs
    assert data.device.op_overhead_s == data.details["step"]["op_dispatch_s"] and "us per op dispatched" in out.stdout
    # the rates are those of a whole training step's ops: memory-bound ones far below a streaming add
    (ref,) = data.details["step"]["timings"]["reference"]
    assert ref["ops"] > 100 and ref["flops"] > 0 and ref["memory_bytes"] > 0 and ref["seconds"] > 0
    in_step, alone = data.details["step"]["in_step"], data.details["step"]["alone"]
    assert (data.device.mem_bw, data.device.peak_flops_fp32) == (in_step["mem_bw"], in_step["fp32_flops"])
    assert in_step["mem_bw"] < alone["mem_bw"] and "inside a training step matmuls and attention" in out.stdout
    with pytest.raises(ValueError, match="has no network profile"):
        network_profile(str(tmp_path / "d.json"), (1,))


def _kind_cost(profile: NetworkProfile, row: dict) -> float:
    """A calibration row's modeled seconds less launch_s, on the link of its kind."""
    per_byte, fixed = linear_cost(profile, row["kind"], tuple(row["mesh_dims"]), row["group_size"])
    return per_byte * row["in_bytes"] + fixed - profile.launch_s


@pytest.mark.slow
@pytest.mark.ranks
def test_torchrun_calibrate_writes_a_profile_the_planner_uses(tmp_path):
    """4 gloo ranks, (2,2), tiny sizes: every planner group timed with every kind, a fit per group,
    and the file plans llama3-tiny through the API with the flattened group's own link."""
    path = tmp_path / "profile.json"
    out = _run(
        torchrun_command(
            "-m",
            "autoshard",
            "calibrate",
            "--mesh",
            "2x2",
            "--quick",
            "--out",
            str(path),
        )
    )
    assert "collectives on mesh dims [0, 1] (4 ranks)" in out.stdout and f"--network {path}" in out.stdout
    data = read_profile(path)
    assert data.mesh_shape == (2, 2) and [dims for dims, _, _ in data.network.groups] == [(0, 1)]
    rows = data.details["collectives"]
    assert {(r["kind"], tuple(r["mesh_dims"])) for r in rows} == {(k, g) for k in KINDS for g in planner_groups((2, 2))}
    assert all(r["seconds"] > 0 and r["model_s"] > 0 for r in rows)
    assert [g["mesh_dims"] for g in data.details["network_fit"]["groups"]] == [[0], [1], [0, 1]]
    between = data.details["between_compute"]  # the profile's launch: back to back plus between compute
    assert data.network.launch_s == pytest.approx(between["launch_back_to_back_s"] + between["extra_s"])
    assert between["extra_s"] >= 0 and [t["mesh_dims"] for t in between["timings"]] == [[0], [1], [0, 1]]
    assert all(t["both_s"] > t["work_s"] > 0 and t["in_bytes"] == 4096 for t in between["timings"])
    assert "between compute); fit error" in out.stdout
    assert all(
        r["model_s"] == pytest.approx(between["launch_back_to_back_s"] + _kind_cost(data.network, r)) for r in rows
    )

    from autoshard.driver.api import AutoShard
    from autoshard.workloads import get_workload
    from autoshard_models import build_model, cross_entropy_loss, get_config

    work = get_workload("llama3-tiny", 16)
    with AutoShard(
        build_model(get_config("llama3-tiny"), device="meta"),
        lambda: work.example_inputs(8, 16, "meta"),
        (2, 2),
        loss_fn=cross_entropy_loss,
        network=str(path),
        device=str(path),
    ) as auto:
        plan = auto.optimize()
    assert auto.network == data.network and auto.device == data.device
    assert plan.step_time_s > 0 and plan.compute_s > 0
