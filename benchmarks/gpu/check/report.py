"""The GPU check's cases, goals and markdown table: one row per figure, a part that did not run in
one row with its status, and each part's notes below (why it was skipped, what it leaves out)."""

from __future__ import annotations

import json
from pathlib import Path

GOALS = {"step": 0.97, "compute": 0.15, "memory": 0.10}  # autoshard / torch; |measured / modeled - 1|
FULL = {
    "step": ("llama3-1b", 2, 4096),  # (model, batch, seq)
    "rank0": ("llama3-8b", (8, 8), 8, 8192),  # (model, mesh, batch, seq)
    "rank0-big": ("llama3-70b", (64, 8), 64, 8192),
}
TINY = {
    "step": ("llama3-tiny", 2, 32),
    "rank0": ("llama3-tiny", (2, 2), 4, 64),
    "rank0-big": ("llama3-tiny", (4, 2), 8, 32),
}


def case_of(name: str, tiny: bool) -> dict:
    """What a part would have run: its sizes, for a row of a part that did not run."""
    sizes = (TINY if tiny else FULL)["step" if name.startswith("step") else name]
    if name.startswith("step"):
        return {"model": sizes[0], "batch": sizes[1], "seq": sizes[2], "compiled": name == "step-compiled"}
    return {"model": sizes[0], "mesh": list(sizes[1]), "batch": sizes[2], "seq": sizes[3]}


def fmt_bytes(n: float | None) -> str:
    return "" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def fmt_rate(v: dict) -> str:
    mfu = f" (MFU {100 * v['mfu']:.1f}%)" if v.get("mfu") is not None else ""
    return f"{v['tokens_per_s']:,.0f} tokens/s{mfu}"


def table(result: dict) -> str:
    """The markdown table of every part's figures (a part not run: its status and why)."""
    meta = result["meta"]
    lines = [
        f"# GPU check: {meta['device']}, torch {meta['torch']}" + (" (--tiny)" if meta["tiny"] else ""),
        "",
        f"Measured {meta['date']} in {meta['seconds']:.0f} s (budget {meta['budget_s']:.0f} s): `{meta['command']}`",
        "",
        "| part | case | figure | autoshard / measured | reference | ratio | goal | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name, part in result["parts"].items():
        if name.startswith("step"):
            case = f"{part['model']} (1), batch {part['batch']}, seq {part['seq']}, bf16 / fp32, " + (
                "torch.compile" if part["compiled"] else "eager"
            )
        else:
            mesh = ", ".join(map(str, part["mesh"]))
            case = f"{part['model']} ({mesh}), batch {part['batch']}, seq {part['seq']}, bf16 / fp32, rank 0"
        if part["status"] != "ok" and "torch" in part.get("variants", {}):  # autoshard's run failed
            torch_rate = fmt_rate(part["variants"]["torch"])
            lines.append(f"| {name} | {case} | tokens/s | {part['status']} | torch {torch_rate} | | | no |")
        elif part["status"] != "ok":
            lines.append(f"| {name} | {case} | {part['status']} | | | | | |")
        elif name.startswith("step"):
            v = part["variants"]
            lines.append(
                f"| {name} | {case} | tokens/s | {fmt_rate(v['autoshard'])} | torch {fmt_rate(v['torch'])} | "
                f"{part['ratio']:.3f} | >= {GOALS['step']} | {'yes' if part['met'] else 'no'} |"
            )
        else:
            lines.append(
                f"| {name} | {case} | forward + backward | {part['compute_measured_s'] * 1e3:.1f} ms | "
                f"modeled {part['compute_modeled_s'] * 1e3:.1f} ms | {part['compute_ratio']:.3f} | "
                f"within {GOALS['compute']:.0%} | {'yes' if part['met_compute'] else 'no'} |"
            )
            if part.get("compute_device_busy_s") is not None:
                busy = part["compute_device_busy_s"]
                lines.append(
                    f"| {name} | {case} | forward + backward, device busy (profiled) | {busy * 1e3:.1f} ms | "
                    f"modeled {part['compute_modeled_s'] * 1e3:.1f} ms | {busy / part['compute_modeled_s']:.3f} | | |"
                )
            lines.append(
                f"| {name} | {case} | fused AdamW | {part['optimizer_measured_s'] * 1e3:.1f} ms | "
                f"modeled {part['optimizer_modeled_s'] * 1e3:.1f} ms | "
                f"{part['optimizer_measured_s'] / max(part['optimizer_modeled_s'], 1e-12):.3f} | | |"
            )
            if part.get("memory_ratio") is not None:
                lines.append(
                    f"| {name} | {case} | peak memory | {fmt_bytes(part['memory_measured_bytes'])} | "
                    f"dry run {fmt_bytes(part['dry_run_peak_bytes'])} | {part['memory_ratio']:.3f} | "
                    f"within {GOALS['memory']:.0%} | {'yes' if part['met_memory'] else 'no'} |"
                )
            else:
                lines.append(
                    f"| {name} | {case} | peak memory | skipped (no allocator peak on CPU) | "
                    f"dry run {fmt_bytes(part['dry_run_peak_bytes'])} | | within {GOALS['memory']:.0%} | |"
                )
        if part.get("attention"):
            att = part["attention"]
            notes.append(
                f"- {name}: attention ({att['kernel']}) against fp32 math, max |error|: output {att['out_err']:.2e}, "
                f"gradients {att['grad_err']:.2e}; torch's own sdpa in bf16: {att['torch_out_err']:.2e}, "
                f"{att['torch_grad_err']:.2e}"
            )
        notes += [f"- {name}: {note}" for note in part.get("notes", [])]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "gpu_check.md").write_text(table(result))
