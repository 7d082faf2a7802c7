"""report.html takes every value from files (plan.json, metrics.jsonl), which anyone may have
edited: each is escaped or refused as a number, so a crafted file shows its text and never adds
markup (issue 51), the validation loss and perplexity included. The page embeds no script, so no
JSON inside one to break out of either."""

from __future__ import annotations

import copy
import json
from typing import Any, Iterator

import pytest

from autoshard.__main__ import main
from autoshard.report.files import write_report_files
from autoshard.report.html import render_html
from test_report_html import VAL_METRICS, Page, report  # noqa: F401 - `report` is the fixture these tests use

X = "<script>alert(1)</script>"
CLOSE = "</script><script>alert(2)</script>"  # what would end a script block the page embedded
REFUSED = (KeyError, TypeError, ValueError, AttributeError, IndexError)  # `report`: one error line, no page


def leaves(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """The paths of every value that is not a dict or list."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from leaves(v, (*path, i))
    else:
        yield path


def dicts(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """The paths of every dict."""
    if isinstance(value, dict):
        yield path
        for k, v in value.items():
            yield from dicts(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from dicts(v, (*path, i))


def at(data: Any, path: tuple) -> Any:
    for step in path:
        data = data[step]
    return data


def by_pattern(paths: Iterator[tuple]) -> dict[tuple, list[tuple]]:
    """Paths grouped by their pattern (list indices as '*'): one field of every parameter, node..."""
    groups: dict[tuple, list[tuple]] = {}
    for path in paths:
        groups.setdefault(tuple("*" if isinstance(s, int) else s for s in path), []).append(path)
    return groups


def assert_no_markup_added(text: str) -> Page:
    page = Page(text)
    assert "<script" not in text.lower() and "</script" not in text.lower() and "script" not in page.tags
    assert not page.errors, page.errors
    return page


@pytest.fixture(scope="module")
def full(report):  # noqa: F811 - the imported fixture
    """The plan report with every optional section the page can show."""
    data = copy.deepcopy(report)
    data["memory_fit"] = {"summary": "the plan as solved fits"}
    data["recompute"] = {"blocks": ["layers"], "ops": 12}
    data["reshard"] = {"blocks": ["layers"], "ops": 4}
    data["totals"]["program_count_by_collective"] = dict(data["totals"]["count_by_collective"])
    render_html(data)  # a valid report
    return data


@pytest.mark.slow
def test_every_value_and_key_of_plan_json_is_escaped_or_refused(full):
    """Each field of plan.json in turn (in one record, then in every record of its kind), and each
    key of each object, set to a script tag: the page either shows it as text or is not built."""
    shown = 0
    for pattern, paths in by_pattern(leaves(full)).items():
        for chosen in (paths[:1], paths):
            data = copy.deepcopy(full)
            for path in chosen:
                at(data, path[:-1])[path[-1]] = X
            try:
                text = render_html(data, VAL_METRICS)
            except REFUSED:
                continue
            shown += X in "".join(assert_no_markup_added(text).text)
    for pattern, paths in by_pattern(dicts(full)).items():
        for key in list(at(full, paths[0])):
            data = copy.deepcopy(full)
            for path in paths:
                obj = at(data, path)
                if key in obj:
                    obj[X] = obj.pop(key)
            try:
                text = render_html(data, VAL_METRICS)
            except REFUSED:
                continue
            shown += X in "".join(assert_no_markup_added(text).text)
    assert shown > 20  # the fields the page shows: as text


def test_a_crafted_run_directory_shows_its_text_escaped(full, tmp_path):
    """`python -m autoshard report RUN_DIR` on a plan.json whose strings and numbers the page shows
    hold script tags, and a metrics.jsonl whose rows do: one well-formed page, no script in it, the
    crafted text shown as text."""
    data = copy.deepcopy(full)
    data["run"] |= {"model": X, "mesh_names": [X, CLOSE], "batch": CLOSE}
    data["parameters"][0] |= {"fqn": X, "dtype": CLOSE}
    data["precision"]["summary"] = X
    data["memory"] |= {"device": X}
    data["memory"]["ranks"][0] |= {"rank": X, "phase": CLOSE}
    data["totals"] |= {"params": X, "non_default_order_params": CLOSE}
    data["totals"]["ilp"] |= {"backend": X, "status": CLOSE}
    data["recompute"]["ops"] = X
    data["timings"][X] = 1.0
    data["totals"]["count_by_collective"][CLOSE] = 1
    write_report_files(full, tmp_path)
    (tmp_path / "plan.json").write_text(json.dumps(data))
    rows = [dict(r) for r in VAL_METRICS]
    rows[0] |= {"loss": X, "note": CLOSE}
    rows[1] |= {"step": X}
    rows[2] |= {"tokens_per_s": CLOSE}
    rows[4] |= {"val_loss": X, "val_ppl": CLOSE}  # validation fields: not numbers, so not shown
    rows[9] |= {"val_ppl": X}
    rows[19] |= {"val_ppl": CLOSE, X: 1.0}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    assert main(["report", str(tmp_path)]) == 0
    text = (tmp_path / "report.html").read_text()
    words = "".join(assert_no_markup_added(text).text)
    assert words.count(X) >= 10 and words.count(CLOSE) >= 5, words
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert text.count("<polyline") == 3  # the curves and the validation marks' line, of the rows that hold numbers
    assert "validation loss: 3.600 at step 20 (3 evaluations)" in words  # the crafted perplexity left out
    assert text[text.index('id="training"') :].count("<circle") == 3
