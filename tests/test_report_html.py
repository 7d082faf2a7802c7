"""report.html (autoshard.report.html): one self-contained page from the report dict, checked as text
and in a real browser (headless chromium; `make test` installs it via apt when it can), and the
`python -m autoshard report RUN_DIR` command that rebuilds it."""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from autoshard.__main__ import main
from autoshard.driver.api import AutoShard
from autoshard.profiles.device import DeviceProfile
from autoshard.report.build import plan_report
from autoshard.report.files import load_metrics, write_report_files
from autoshard.report.html import MESH_COLORS, layout_svg, render_html, step_by_block
from autoshard_models import build_model, cross_entropy_loss, get_config

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
METRICS = [{"step": s, "loss": 5.5 - 0.1 * s, "step_s": 0.5, "tokens_per_s": 1000.0 + 10 * s} for s in range(1, 21)]
# the same run evaluated every 5 steps (--eval-every 5), as train writes it
VAL_METRICS = [r | ({"val_loss": 5.6 - 0.1 * r["step"], "val_ppl": 0.0} if r["step"] % 5 == 0 else {}) for r in METRICS]
for _row in VAL_METRICS:
    if "val_loss" in _row:
        _row["val_ppl"] = math.exp(_row["val_loss"])


@pytest.fixture(scope="module")
def report():
    """A llama3-tiny plan on a (2, 2) mesh with its dry run, so the memory section is shown."""
    model = build_model(get_config("llama3-tiny"), device="meta")
    inputs = lambda: (torch.empty(4, 16, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    with AutoShard(model, inputs, (2, 2), loss_fn=cross_entropy_loss) as auto:
        auto.memory_budget(sum(4 * p.numel() for p in model.parameters()) / 4)  # sharded: collectives to show
        plan = auto.optimize()
        memory = auto.dry_run()
    report = plan_report(
        plan,
        dry_run=memory,
        device=DeviceProfile.preset("h100"),
        timings=auto.timings,
        extra={"run": {"model": "llama3-tiny", "mesh_names": ["dp", "tp"], "batch": 4, "seq": 16}},
    )
    return json.loads(json.dumps(report))  # as plan.json holds it


class Page(HTMLParser):
    """Text nodes, tags, and a strict open/close check (every non-void tag closed, in order)."""

    def __init__(self, text: str):
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.text: list[str] = []
        self.tags: dict[str, int] = {}
        self.attrs: list[tuple[str, str | None]] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1
        self.attrs += attrs
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


@pytest.mark.slow
def test_page_is_well_formed_self_contained_and_lists_every_fqn(report):
    text = render_html(report)
    page = Page(text)
    assert not page.errors and page.stack in ([], ["html"]), (page.errors, page.stack)
    assert page.tags["svg"] > 5 and text.count("<svg") == text.count("</svg>")
    assert "http://" not in text and "https://" not in text  # no network: not even an SVG namespace
    assert "<script" not in text and not any(name in ("src", "href") for name, _ in page.attrs)
    words = "\n".join(page.text)
    for p in report["parameters"]:
        assert p["fqn"] in words, p["fqn"]  # as text, not only in an attribute
    assert "layers.*.attention.wq.weight" in words and "All 2 blocks share these layouts." in words
    assert "S(0)S(0)[1,0]" in words  # layout strings and local shapes as text too
    assert "Memory per rank" in words and "79.2 GiB" in words and "fits" in words  # beside the h100's capacity
    assert "Modeled step per block" in words and "layers.0" in words and "Collectives per rank by kind" in words
    assert 'id="training"' not in text  # no metrics given: no curves


def test_curves_appear_only_with_metrics(report):
    text = render_html(report, METRICS)
    page = Page(text)
    assert not page.errors
    assert 'id="training"' in text and text.count("<polyline") == 2
    words = "\n".join(page.text)
    assert "loss: 3.500 at step 20 (20 steps)" in words and "tokens/s: 1,200 at step 20" in words
    assert "<polyline" not in render_html(report)


def test_validation_loss_is_marked_beside_the_loss(report):
    """Rows with val_loss: a mark per evaluation on the loss chart, joined by a dashed line, and the
    last validation loss and perplexity; the page of rows without any is the one it always was."""
    text = render_html(report, VAL_METRICS)
    page = Page(text)
    assert not page.errors
    training = text[text.index('id="training"') :]
    assert training.count("<circle") == 4 and text.count("<polyline") == 3 and 'stroke-dasharray="4 3"' in training
    words = "\n".join(page.text)
    assert "validation loss: 3.600, perplexity 36.60 at step 20 (4 evaluations)" in words
    assert "step 5: validation loss 5.100" in words and "validation loss (every --eval-every steps)" in words
    assert "loss: 3.500 at step 20 (20 steps)" in words  # the training loss's line as before
    plain = render_html(report, METRICS)
    assert "validation" not in plain and "<circle" not in plain[plain.index('id="training"') :]
    unevaluated = [{k: v for k, v in r.items() if not k.startswith("val_")} for r in VAL_METRICS]
    assert render_html(report, unevaluated) == plain
    one = render_html(report, [*METRICS[:-1], METRICS[-1] | {"val_loss": 3.25, "val_ppl": math.inf}])
    assert "validation loss: 3.250, perplexity inf at step 20 (1 evaluation)" in "\n".join(Page(one).text)
    assert one.count("<polyline") == 2 and one[one.index('id="training"') :].count("<circle") == 1
    diverged = [*VAL_METRICS[:-1], VAL_METRICS[-1] | {"val_loss": math.nan, "val_ppl": math.nan}]
    text = render_html(report, diverged)  # the last evaluation said nan: told, not drawn
    assert "validation loss: nan, perplexity nan at step 20" in "\n".join(Page(text).text)
    assert text[text.index('id="training"') :].count("<circle") == 3
    assert not any("nan" in points for points in re.findall(r'(?:points|cx|cy)="[^"]*"', text))


def test_a_block_that_differs_is_named(report):
    changed = copy.deepcopy(report)
    p = next(p for p in changed["parameters"] if p["fqn"] == "layers.1.attention.wq.weight")
    p["layout"] = "RR" if p["layout"] != "RR" else "S(0)R"
    words = "\n".join(Page(render_html(changed)).text)
    assert "Not every block has the same layouts:" in words and "differs between blocks" in words
    assert "in blocks 1" in words


def test_step_per_block_adds_up_to_the_totals(report):
    rows = step_by_block(report)
    assert set(list(rows)[:2]) == {"(step)", "tok_embeddings"} and {"layers.0", "layers.1", "output"} <= set(rows)
    t = report["totals"]
    assert sum(r["compute"] for r in rows.values()) == pytest.approx(t["compute_s"])
    assert sum(v for r in rows.values() for k, v in r.items() if k != "compute") == pytest.approx(t["comm_s"])


def test_layout_grid_splits_in_device_order():
    """S(0)S(0)[1,0] on (dp=2, tp=2): rows split first by tp (the thick middle line), then by dp."""
    svg = layout_svg([64, 64], "S(0)S(0)[1,0]", [2, 2], ["dp", "tp"])
    lines = re.findall(r'<line x1="0" y1="([\d.]+)".*?stroke="(#\w+)" stroke-width="([\d.]+)"', svg)
    assert len(lines) == 3
    (_, c1, w1), (_, c2, w2), (_, c3, w3) = lines
    assert c2 == MESH_COLORS[1] and c1 == c3 == MESH_COLORS[0] and float(w2) > float(w1) == float(w3)
    labels = re.findall(r">([a-z0-9 ]+)</text>", svg)
    assert labels == ["tp0 dp0", "tp0 dp1", "tp1 dp0", "tp1 dp1"]  # top to bottom
    assert "<line" not in layout_svg([64], "RR", [2, 2], ["dp", "tp"])  # replicated: one piece


# ------------------------------------------------------------------------------------ the report command
def test_report_command_rebuilds_the_page_with_curves(report, tmp_path, capsys):
    write_report_files(report, tmp_path)
    assert (tmp_path / "report.html").exists() and "<polyline" not in (tmp_path / "report.html").read_text()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in METRICS))
    assert main(["report", str(tmp_path)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "report.html").read_text() == render_html(report, load_metrics(tmp_path / "metrics.jsonl"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "plan.json", "report.html", "sharding.log"]


def test_report_command_shows_a_run_directorys_validation_loss(report, tmp_path):
    """A run directory whose metrics.jsonl has val_loss rows (json writes an infinite perplexity as
    Infinity): the rebuilt page shows them; the same run without them gives the page it gave before."""
    write_report_files(report, tmp_path)
    rows = [*VAL_METRICS[:-1], VAL_METRICS[-1] | {"val_loss": 710.0, "val_ppl": math.inf}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "Infinity" in (tmp_path / "metrics.jsonl").read_text()
    assert main(["report", str(tmp_path)]) == 0
    text = (tmp_path / "report.html").read_text()
    words = "\n".join(Page(text).text)
    assert "validation loss: 710.000, perplexity inf at step 20 (4 evaluations)" in words
    assert text[text.index('id="training"') :].count("<circle") == 4
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in METRICS))
    assert main(["report", str(tmp_path)]) == 0
    again = (tmp_path / "report.html").read_text()
    assert again == render_html(report, METRICS) and "validation" not in again


@pytest.mark.parametrize(
    "setup, message",
    [
        (None, "is not a directory"),
        ({}, "no plan.json in"),
        ({"plan.json": "{not json"}, "plan.json: not JSON"),
        ({"plan.json": "[1, 2]"}, "is not an autoshard plan report"),
        (
            {"plan.json": '{"mesh_shape": [2], "parameters": [{}], "nodes": [], "totals": {}}'},
            "is not an autoshard plan report",
        ),
        (
            {"plan.json": "GOOD", "metrics.jsonl": '{"step": 1, "loss": 2.0}\n{"step": 2, "lo'},
            "metrics.jsonl:2: not JSON",
        ),
    ],
)
def test_report_command_bad_input_is_one_error_line_and_writes_nothing(report, setup, message, tmp_path, capsys):
    run_dir = tmp_path / "run"
    if setup is not None:
        run_dir.mkdir()
        for name, content in setup.items():
            (run_dir / name).write_text(json.dumps(report) if content == "GOOD" else content)
    with pytest.raises(SystemExit) as exc:
        main(["report", str(run_dir)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("error: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (run_dir / "report.html").exists() and sorted(p.name for p in tmp_path.rglob("*.tmp")) == []


# ------------------------------------------------------------------------------------ in a real browser
def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.skip(
        "chromium not found: the browser check of report.html is skipped "
        "(`make test` installs it with apt when run as root; or `apt-get install chromium`)"
    )


def _chromium_run(page: Path, tmp_path: Path, *args: str) -> tuple[str, list[str]]:
    """Load `page` headless; returns (stdout, console messages). Chromium logs every console
    message of the page (console.log/error, uncaught exceptions, SVG attribute errors) to stderr as
    `...:INFO:CONSOLE:<line>] "<message>", source: <url> (<line>)` (older builds: `CONSOLE(<line>)`);
    the page has no script, so any such line is an error."""
    cmd = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--enable-logging=stderr",
        "--v=0",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        *args,
        page.resolve().as_uri(),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, [line for line in done.stderr.splitlines() if re.search(r"\bCONSOLE[:(]\d+", line)]


def test_console_check_catches_a_broken_page(tmp_path):
    """The detector itself: a page with a script error and a bad SVG attribute is caught."""
    page = tmp_path / "broken.html"
    page.write_text(
        '<!DOCTYPE html><html><body><svg width="9" height="9"><rect width="-5" height="4"></rect></svg>'
        "<script>undefinedFunction();</script></body></html>"
    )
    _, console = _chromium_run(page, tmp_path, "--dump-dom")
    assert any("undefinedFunction is not defined" in line for line in console), console
    assert any("<rect> attribute width" in line for line in console), console


def test_report_renders_in_chromium(report, tmp_path):
    write_report_files(report, tmp_path, metrics=VAL_METRICS)
    page = tmp_path / "report.html"
    dom, console = _chromium_run(page, tmp_path, "--dump-dom")
    assert console == []
    words = "\n".join(Page(dom).text)
    missing = [p["fqn"] for p in report["parameters"] if p["fqn"] not in words]
    assert not missing and "<polyline" in dom
    shot = tmp_path / "report.png"
    _, console = _chromium_run(page, tmp_path, f"--screenshot={shot}", "--window-size=1400,3000")
    assert console == []
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000
