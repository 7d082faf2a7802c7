"""What goes into a run is checked, and said once: a resume compares the data by content, not by how
its paths are spelled (other files, a file rewritten or a tokenizer retrained in place are refused,
or, forced, recorded; the same files named another way resume; the fingerprint reads a few blocks
per file); a NaN stop names a checkpoint that had not diverged; damaged metrics, an unwritable
--out, --wandb without a key are one error line before planning; `plan`'s output is a --plan-file."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from autoshard.cli.train import main
from autoshard.data.fingerprint import BLOCK, SAMPLES, file_digest
from test_data import documents, tokenizer_file, write_text  # noqa: F401 - a fixture
from test_train import TINY, metrics

pytestmark = pytest.mark.replicated_plan  # one process: what these check is the resume's refusal


def token_dir(folder: Path, files: int = 2) -> Path:
    folder.mkdir(parents=True)
    for i in range(files):
        np.random.default_rng(i).integers(0, 256, 4096, dtype=np.uint16).tofile(folder / f"{i}.bin")
    return folder


def errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


@pytest.mark.slow
def test_the_same_files_spelled_another_way_resume(tmp_path, monkeypatch):
    data = token_dir(tmp_path / "dd")
    out = tmp_path / "run"
    assert main([*TINY, "--steps", "2", "--checkpoint-every", "2", "--data", str(data), "--out", str(out)]) == 0
    monkeypatch.chdir(tmp_path)
    assert main([*TINY, "--steps", "3", "--checkpoint-every", "2", "--data", "dd/", "--out", str(out)]) == 0
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["changed_on_resume"] == {"steps": [2, 3]}


@pytest.mark.slow
@pytest.mark.parametrize("change", ["added", "rewritten"])
def test_other_files_under_the_same_path_are_refused_and_forced_recorded(tmp_path, capsys, change):
    data = token_dir(tmp_path / "dd")
    out = str(tmp_path / "run")
    args = [*TINY, "--checkpoint-every", "2", "--data", str(data), "--out", out]
    assert main([*args, "--steps", "2"]) == 0
    if change == "added":
        shutil.copy(data / "0.bin", data / "2.bin")
        said = "--data: 3 files, the run's had 2"
    else:
        tokens = np.fromfile(data / "1.bin", dtype=np.uint16)
        tokens[::7] = 5
        tokens.tofile(data / "1.bin")  # the same size
        said = "--data: 1 of its 2 files differ from the run's (size or content)"
    capsys.readouterr()
    assert main([*args, "--steps", "3"]) == 2
    assert errors(capsys) == [
        f"error: resuming {out} with settings that define another run ({said}): its losses would mix two runs; "
        "use another --out, or --resume force to continue anyway (recorded in metrics.jsonl)"
    ]
    assert main([*args, "--steps", "3", "--resume", "force"]) == 0
    assert metrics(Path(out))[2]["changed_on_resume"] == {"data": [said], "steps": [2, 3]}


def test_a_tokenizer_retrained_in_place_is_refused(tmp_path, capsys, tokenizer_file):  # noqa: F811
    data = write_text(tmp_path / "data", documents(30))["jsonl"]
    tok = tmp_path / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    shutil.copy(tokenizer_file, tok)
    out = str(tmp_path / "run")
    args = [*TINY, "--checkpoint-every", "2", "--data", str(data), "--tokenizer", str(tok), "--out", out]
    args += ["--data-cache", str(tmp_path / "cache")]
    assert main([*args, "--steps", "2"]) == 0
    spec = json.loads(tok.read_text())
    vocab = spec["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[-2:]  # swap two ids: the same vocabulary size
    vocab[first], vocab[second] = vocab[second], vocab[first]
    tok.write_text(json.dumps(spec))
    capsys.readouterr()
    assert main([*args, "--steps", "3"]) == 2
    (line,) = errors(capsys)
    assert "--tokenizer: not the run's tokenizer (its tokenizer.json or EOS token differ)" in line


def test_the_fingerprint_reads_blocks_not_the_file(tmp_path):
    path = tmp_path / "big.bin"
    size = 64 * (SAMPLES + 1) * BLOCK
    with path.open("wb") as f:
        f.truncate(size)
    start = time.perf_counter()
    before = file_digest(path)
    assert time.perf_counter() - start < 1.0
    with path.open("r+b") as f:
        f.seek(size // 2 - BLOCK // 2)  # the middle block is one of the samples
        f.write(b"x")
    assert file_digest(path) != before
    os.truncate(path, size - 1)
    assert file_digest(path) not in (before,)


@pytest.mark.slow
def test_the_checkpoint_a_nan_stop_names_is_one_whose_loss_had_not_diverged(tmp_path, capsys):
    """Resumed from step 3 at --lr 1e30: step 4's loss is still sound, its update is not, and step
    5's loss is not finite. Step 4's checkpoint is finite but diverged: the stop names step 3's."""
    out = tmp_path / "run"
    args = [*TINY, "--checkpoint-every", "1", "--keep-checkpoints", "0", "--out", str(out)]
    assert main([*args, "--steps", "3"]) == 0
    capsys.readouterr()
    assert main([*args, "--steps", "8", "--lr", "1e30"]) == 2
    (line,) = errors(capsys)
    assert line.startswith("error: step 5: the loss is nan;"), line
    assert line.endswith(
        f"the newest good checkpoint is {out / 'checkpoints' / 'step-000003'} (resume from it: remove the "
        "checkpoints after it, or copy it to a new --out)"
    ), line


@pytest.mark.slow
def test_init_from_on_a_resumed_run_says_it_is_not_used(tmp_path, capsys):
    from safetensors.torch import save_file

    from autoshard_models import build_model, get_config

    weights = tmp_path / "init.safetensors"
    save_file(
        {k: v.contiguous() for k, v in build_model(get_config("llama3-tiny"), seed=3).state_dict().items()},
        str(weights),
    )
    out = str(tmp_path / "run")
    args = [*TINY, "--checkpoint-every", "2", "--init-from", str(weights), "--out", out]
    assert main([*args, "--steps", "2"]) == 0
    capsys.readouterr()
    assert main([*args, "--steps", "3"]) == 0
    assert (
        f"warning: --init-from {weights} is not used: the run continues from its checkpoint" in capsys.readouterr().err
    )


def test_a_damaged_metrics_row_before_the_last_is_one_error_line(tmp_path, capsys):
    out = tmp_path / "run"
    args = [*TINY, "--checkpoint-every", "2", "--out", str(out)]
    assert main([*args, "--steps", "3"]) == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join([lines[0], "{damaged", *lines[2:]]) + "\n")
    capsys.readouterr()
    assert main([*args, "--steps", "4"]) == 2
    err = capsys.readouterr().err
    assert (
        errors_in(err)
        == [
            f"error: {out / 'metrics.jsonl'}:2: not a metrics row (Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1)); repair or remove that line to resume"
        ]
        and "Traceback" not in err
    )


def errors_in(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def test_an_error_line_is_said_once_per_launch_even_with_a_repeated_rdzv_id(tmp_path, capsys, monkeypatch):
    """Two launches with the same run id (a requeued job): each says its line once; the first's
    claim is removed once its agent has ended."""
    import subprocess
    import sys

    from autoshard.cli import train as cli

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    for agent in (first.pid, os.getpid()):
        monkeypatch.setattr(os, "getppid", lambda agent=agent: agent)
        cli.print_once_per_host("error: same", folder=str(tmp_path))
        cli.print_once_per_host("error: same", folder=str(tmp_path))  # another rank of the launch
        first.kill()
        first.wait()
    assert capsys.readouterr().err.splitlines() == ["error: same", "error: same"]
    assert [p.name.split("-")[2] for p in tmp_path.iterdir()] == [str(os.getpid())]


@pytest.mark.slow
def test_a_start_that_failed_after_planning_does_not_block_the_corrected_command(tmp_path, capsys):
    """What a start that failed after planning leaves (its plan, report and an empty metrics file)
    is replaced by the next start without --overwrite; a run that ran a step is still protected."""
    out = tmp_path / "run"
    assert main([*TINY, "--steps", "2", "--out", str(out)]) == 0
    (out / "metrics.jsonl").write_text("")
    assert main([*TINY, "--steps", "2", "--out", str(out)]) == 0
    assert [r["step"] for r in metrics(out)] == [1, 2]
    capsys.readouterr()
    assert main([*TINY, "--steps", "2", "--out", str(out)]) == 2
    assert "holds an earlier run" in capsys.readouterr().err


def test_wandb_online_without_a_key_is_refused_before_planning(tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    out = tmp_path / "run"
    assert main([*TINY, "--steps", "2", "--wandb", "proj", "--out", str(out)]) == 2
    assert errors(capsys) == [
        "error: --wandb proj: no W&B API key (set WANDB_API_KEY or run `wandb login`; WANDB_MODE=offline logs "
        "without one)"
    ]
    assert not out.exists()


def test_an_out_no_file_can_be_made_in_is_refused_before_planning(capsys):
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc")
    assert main([*TINY, "--steps", "2", "--out", "/proc/autoshard-x"]) == 2
    (line,) = errors(capsys)
    assert line.startswith("error: --out /proc/autoshard-x: cannot write into /proc (")


@pytest.mark.slow
def test_plans_own_file_is_a_plan_file(tmp_path, capsys):
    from autoshard.cli.plan import plan_main

    profiles = ["--network", "cpu-gloo", "--device", "cpu"]
    assert plan_main([*TINY, "--mesh", "1", *profiles, "--out", str(tmp_path / "plan")]) in (0, None)
    capsys.readouterr()
    args = [*TINY, "--steps", "1", "--plan-file", str(tmp_path / "plan" / "plan.json"), "--out", str(tmp_path / "r")]
    assert main(args) == 0
    assert "reusing the solution in --plan-file" in capsys.readouterr().err


def test_export_ships_the_tokenizer_the_run_trained_with(tmp_path, tokenizer_file):  # noqa: F811
    """The tokenizer is kept in the run directory at the start: replaced at its path, or gone, the
    export still ships the one the run trained with."""
    from autoshard.train.export import export_hf

    data = write_text(tmp_path / "data", documents(30))["jsonl"]
    tok = tmp_path / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    shutil.copy(tokenizer_file, tok)
    trained_with = tok.read_bytes()
    out = tmp_path / "run"
    args = [*TINY, "--steps", "2", "--checkpoint-every", "2", "--data", str(data), "--tokenizer", str(tok)]
    assert main([*args, "--data-cache", str(tmp_path / "cache"), "--out", str(out)]) == 0
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == trained_with
    tok.write_text('{"replaced": true}')  # replaced in place
    export_hf(out, tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == trained_with
    tok.unlink()  # gone
    export_hf(out, tmp_path / "hf2")
    assert (tmp_path / "hf2" / "tokenizer.json").read_bytes() == trained_with
    shutil.rmtree(out / "tokenizer")  # a run from before copies were kept, its tokenizer gone
    with pytest.raises(ValueError, match="which is gone"):
        export_hf(out, tmp_path / "hf3")


def test_a_full_disk_while_writing_metrics_is_one_error_line(tmp_path, capsys, monkeypatch):
    import errno

    from autoshard.train import metrics as metrics_module

    opened = Path.open

    def full(self, mode="r", *args, **kwargs):
        if self.name == "metrics.jsonl" and mode == "a":
            raise OSError(errno.ENOSPC, "No space left on device")
        return opened(self, mode, *args, **kwargs)

    monkeypatch.setattr(metrics_module.Path, "open", full)
    out = tmp_path / "run"
    assert main([*TINY, "--steps", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (
        errors_in(err)
        == [
            f"error: cannot write {out / 'metrics.jsonl'}: No space left on device; the newest complete checkpoint "
            f"is in {out / 'checkpoints'} (the same command resumes from it)"
        ]
        and "Traceback" not in err
    )


def test_a_signal_while_tokenizing_stops_with_its_line(tmp_path, tokenizer_file):  # noqa: F811
    import signal
    import subprocess
    import sys

    from torchrun import ROOT, child_env

    big = tmp_path / "big.txt"
    text = "\n\n".join(documents(400, seed=1))
    big.write_text(text * (12_000_000 // len(text) + 1))  # past the size that says it is tokenizing
    cmd = [sys.executable, "-m", "autoshard", "train", *TINY, "--mesh", "1", "--steps", "2", "--data", str(big)]
    cmd += ["--tokenizer", str(tokenizer_file), "--data-cache", str(tmp_path / "cache"), "--out", str(tmp_path / "r")]
    proc = subprocess.Popen(cmd, env=child_env(), cwd=ROOT, stderr=subprocess.PIPE, text=True)
    seen, rest = [], ""
    try:
        for line in proc.stderr:
            seen.append(line)
            if "autoshard data: tokenizing" in line:
                proc.send_signal(signal.SIGTERM)
                break
        _, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = "".join(seen) + rest
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "autoshard train: stopped by SIGTERM before the first step (nothing written)" in err, err[-3000:]
    assert "Traceback" not in err and not (tmp_path / "r").exists()


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_a_full_disk_while_writing_tensorboard_events_is_one_error_line(tmp_path, capsys, monkeypatch):
    import errno

    from torch.utils.tensorboard import SummaryWriter

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SummaryWriter, "add_scalar", full)
    out = tmp_path / "run"
    assert main([*TINY, "--steps", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (
        errors_in(err)
        == [
            f"error: cannot write TensorBoard events in {out / 'tensorboard'}: No space left on device; the newest "
            f"complete checkpoint is in {out / 'checkpoints'} (the same command resumes from it)"
        ]
        and "Traceback" not in err
    )


def test_a_plan_file_whose_solution_is_damaged_is_one_error_line(tmp_path, capsys):
    from autoshard.cli.plan import plan_main

    profiles = ["--network", "cpu-gloo", "--device", "cpu"]
    assert plan_main([*TINY, "--mesh", "1", *profiles, "--out", str(tmp_path / "plan")]) in (0, None)
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    solution = json.loads(plan["solution"])
    del solution["stats"]
    plan["solution"] = json.dumps(solution)
    (tmp_path / "bad.json").write_text(json.dumps(plan))
    capsys.readouterr()
    assert main([*TINY, "--steps", "1", "--plan-file", str(tmp_path / "bad.json"), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert (
        errors_in(err)
        == [f"error: --plan-file {tmp_path / 'bad.json'}: its solution is damaged (not a solution (KeyError: 'stats'))"]
        and "Traceback" not in err
    )
