"""Checkpoints that cannot run code: a run directory from elsewhere whose `.metadata` (or a value
DCP `torch.save`d into a data file) is a pickle with a `__reduce__` payload is refused by resume,
by export, and never read by report; the payload's marker file is not created, and the refusal is
one `error:` line naming the file. Genuine checkpoints read as torch reads them."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch

from autoshard.__main__ import main as autoshard_main
from autoshard.cli.train import main as train_main
from autoshard.train.safe_metadata import UnsafeCheckpointError, read_metadata

TINY = ["--model", "llama3-tiny", "--batch", "8", "--seq", "16", "--mesh", "1"]
STEP = Path("checkpoints") / "step-000001"
ONE_PROCESS = pytest.mark.replicated_plan


class Payload:
    """Unpickled without restriction, this creates `marker` (what an attacker's code would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


@pytest.fixture(scope="module")
def genuine_run(tmp_path_factory) -> Path:
    """A one-step training run with its checkpoint, made once; each test copies it."""
    run = tmp_path_factory.mktemp("safety") / "run"
    assert train_main([*TINY, "--steps", "1", "--checkpoint-every", "1", "--out", str(run)]) == 0
    return run


def payload(marker: Path) -> bytes:
    """A pickle that creates `marker` when loaded, checked live here (so a refusal means something)."""
    data = pickle.dumps(Payload(marker))
    pickle.loads(data)
    assert marker.exists()
    marker.unlink()
    return data


@pytest.fixture
def crafted_metadata(tmp_path, genuine_run) -> tuple[Path, Path]:
    """(run, marker): a copy of the genuine run whose checkpoint's .metadata is a payload."""
    run, marker = tmp_path / "run", tmp_path / "MARKER"
    shutil.copytree(genuine_run, run)
    (run / STEP / ".metadata").write_bytes(payload(marker))
    return run, marker


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("error:")]


@ONE_PROCESS
def test_export_refuses_a_crafted_metadata_and_runs_nothing(tmp_path, capsys, crafted_metadata):
    run, marker = crafted_metadata
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        autoshard_main(["export", str(run), "--hf", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.splitlines() == error_lines(err), err
    (line,) = error_lines(err)
    assert f"{run / STEP / '.metadata'}: refused" in line and "builtins.exec" in line, line
    assert not marker.exists() and not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


@ONE_PROCESS
def test_resume_refuses_a_crafted_metadata_and_runs_nothing(capsys, crafted_metadata):
    run, marker = crafted_metadata
    capsys.readouterr()
    assert train_main([*TINY, "--steps", "2", "--checkpoint-every", "1", "--out", str(run)]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert f"{run / STEP / '.metadata'}: refused" in line, line
    assert not marker.exists() and not (run / "checkpoints" / "step-000002").exists()


@ONE_PROCESS
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the crafting's dcp.save, in one process
def test_resume_refuses_a_crafted_value_in_a_data_file_and_runs_nothing(tmp_path, capsys, genuine_run):
    """The metadata genuine, one optimizer setting (a `torch.save`d value, which torch's planner
    loads with weights_only=False) a payload: refused by torch's weights-only unpickler."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run, marker = tmp_path / "run", tmp_path / "MARKER"
    shutil.copytree(genuine_run, run)
    dcp_to_torch_save(str(run / STEP), str(tmp_path / "whole.pt"))  # the genuine one, read by torch
    state = torch.load(tmp_path / "whole.pt", weights_only=True)
    payload(marker)
    state["optim"]["param_groups.tok_embeddings.weight.lr"] = Payload(marker)  # groups keyed by parameter
    shutil.rmtree(tmp_path / "re", ignore_errors=True)
    dcp.save(state, checkpoint_id=str(tmp_path / "re"), no_dist=True)
    for part in (tmp_path / "re").iterdir():
        shutil.copyfile(part, run / STEP / part.name)
    read_metadata(run / STEP)  # the metadata is a genuine one
    capsys.readouterr()
    assert train_main([*TINY, "--steps", "2", "--checkpoint-every", "1", "--out", str(run)]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert f"{run / STEP / '__0_0.distcp'}: refused: a value in it is not plain data" in line, line
    assert not marker.exists() and not (run / "checkpoints" / "step-000002").exists()


@ONE_PROCESS
def test_report_never_reads_a_checkpoint(capsys, crafted_metadata):
    """`report` rebuilds report.html from plan.json and metrics.jsonl only: a crafted checkpoint
    beside them is not opened."""
    run, marker = crafted_metadata
    assert autoshard_main(["report", str(run)]) == 0
    assert not marker.exists() and not error_lines(capsys.readouterr().err)


@ONE_PROCESS
def test_a_genuine_metadata_reads_as_torch_reads_it(genuine_run):
    from torch.distributed.checkpoint import FileSystemReader

    ours, torchs = read_metadata(genuine_run / STEP), FileSystemReader(str(genuine_run / STEP)).read_metadata()
    assert ours.state_dict_metadata == torchs.state_dict_metadata and ours.storage_data == torchs.storage_data
    assert ours.planner_data == torchs.planner_data


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda m: pickle.dumps(Payload(m)), "refused: its pickle asks for builtins.exec"),
        (lambda m: b"cos\nsystem\n(S'touch " + str(m).encode() + b"'\ntR.", "refused: its pickle asks for os.system"),
        (lambda m: pickle.dumps(torch.load), "refused: its pickle asks for torch.serialization.load"),
        (lambda m: pickle.dumps({"not": "metadata"}), "it holds a dict, not DCP metadata"),
        (lambda m: pickle.dumps(Payload(m))[:10], "UnpicklingError"),
    ],
)
def test_read_metadata_admits_nothing_else(tmp_path, build, message):
    """Payloads of every form (protocol 0's GLOBAL too, a torch function) raise before they run;
    a plain object or a truncated pickle is a damaged checkpoint, not a crafted one."""
    marker = tmp_path / "MARKER"
    (tmp_path / ".metadata").write_bytes(build(marker))
    with pytest.raises((UnsafeCheckpointError, pickle.UnpicklingError, EOFError)) as err:
        read_metadata(tmp_path)
    assert message in f"{type(err.value).__name__}: {err.value}" and not marker.exists()
    assert isinstance(err.value, UnsafeCheckpointError) == ("refused" in message)


def test_a_metadata_naming_a_file_outside_the_checkpoint_is_damaged(tmp_path, genuine_run):
    metadata = read_metadata(genuine_run / STEP)
    for info in metadata.storage_data.values():
        info.relative_path = "../../../etc/passwd"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(pickle.UnpicklingError, match="outside the checkpoint's directory"):
        read_metadata(tmp_path)


@pytest.mark.parametrize("opcode", [b"\x95", b"\x8e", b"\x8d"])  # FRAME, BINBYTES8, BINUNICODE8
def test_a_length_past_the_end_is_damaged_before_anything_is_allocated(tmp_path, opcode):
    """32 bytes asking for 2 GiB: refused as damaged with (almost) nothing allocated."""
    import struct
    import tracemalloc

    (tmp_path / ".metadata").write_bytes((b"\x80\x04" + opcode + struct.pack("<Q", 2**31) + b"N.").ljust(32))
    tracemalloc.start()
    try:
        with pytest.raises(pickle.UnpicklingError):
            read_metadata(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak
