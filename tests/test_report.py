"""The HTML calibration report, rendered in a real headless Chromium."""

from __future__ import annotations

import io
import os
import shutil

import pytest
from conftest import make_random_artifact

from artifacts import open_artifact, write_artifact
from artifacts.cli import main as inspect_main
from artifacts.report import colour, render_report


def _pixels(image) -> set[tuple[int, ...]]:
    """The distinct RGB pixels of a PIL image (through numpy: Pillow 13 deprecates getdata, Pillow 10 lacks
    its successor get_flattened_data)."""
    import numpy as np

    return set(map(tuple, np.asarray(image).reshape(-1, 3).tolist()))


EVALUATION = {
    "baseline": {"accuracy": 0.8},
    "results": [
        {"policy": policy, "compression_ratio": ratio, "accuracy": max(0.0, 0.8 - ratio * slope)}
        for policy, slope in [("uniform/keydiff", 0.5), ("inf/expected_attention", 0.3)]
        for ratio in (0.5, 0.75, 0.9)
    ],
    "recommendation": {"text": "inf/expected_attention at ratio 0.5"},
}


def test_colour_map_endpoints():
    assert colour(0.0) == "#440154" and colour(1.0) == "#fde725" and colour(7.0) == "#fde725"


def test_report_holds_every_section_and_escapes_text(tmp_path):
    artifact = make_random_artifact()
    artifact.config["note"] = "<script>alert(1)</script>"
    path = write_artifact(tmp_path / "a.h5", artifact)
    with open_artifact(path) as reader:
        page = render_report(reader, EVALUATION)
    # RAsc, LCsc, INFsc, budgets, budget curves at 0.5 / 0.75 / 0.9, mean norm, cov trace, learned scorer
    assert page.count('class="heatmap"') == 10
    assert page.count("<rect") >= 3 * 30 * 9 + 30 * 3
    assert page.count('class="curve"') == 2 and 'class="baseline"' in page
    assert 'id="moments-table"' in page and "<script>" not in page and "&lt;script&gt;" in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")  # no network assets


def test_report_shows_the_lm_eval_tasks_beside_the_needles(tmp_path):
    """evaluate-artifact --lm-eval-tasks --html: the lm-eval rows in a table of their own."""
    row = {"task": "niah_single_1", "metric": "4096", "n": 20, "low": 0.5, "high": 0.9}
    lm_eval = {
        "tasks": ["niah_single_1"],
        "limit": 20,
        "question": "auto",
        "reference": "lm-eval's hf model on the unmodified model",
        "rows": [
            {**row, "ratio": None, "mean": 0.75, "wins": None, "losses": None, "paired": 0},
            {**row, "ratio": 0.9, "mean": 0.7, "wins": 1, "losses": 2, "paired": 20},
        ],
    }
    path = write_artifact(tmp_path / "a.h5", make_random_artifact())
    with open_artifact(path) as reader:
        page = render_report(reader, {**EVALUATION, "lm_eval": lm_eval})
        plain = render_report(reader, EVALUATION)
    table = page.split('id="lm-eval-table"')[1].split("</table>")[0]
    assert "<td>niah_single_1</td><td>4096</td><td>uncompressed</td><td>20</td><td>0.750</td>" in table
    assert "<td>0.9</td><td>20</td><td>0.700</td><td>0.500&ndash;0.900</td><td>1 / 2 of 20</td>" in table
    assert "hf model on the unmodified model" in page and 'id="lm-eval-table"' not in plain


def _chromium():
    driver = shutil.which("chromedriver")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if driver and browser:
        return driver, browser
    message = "headless Chromium is needed (Debian packages chromium and chromium-driver)"
    if os.environ.get("CI"):
        pytest.fail(message + "; CI must install them")
    pytest.skip(message)


def test_report_renders_in_headless_chromium(tmp_path):
    driver_path, browser_path = _chromium()
    from PIL import Image
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    path = write_artifact(tmp_path / "a.h5", make_random_artifact())
    html = tmp_path / "report.html"
    assert inspect_main([str(path), "--html", str(html)]) == 0
    with open_artifact(path) as reader:  # the evaluation variant, with curves
        html.write_text(render_report(reader, EVALUATION), encoding="utf-8")

    options = webdriver.ChromeOptions()
    options.binary_location = browser_path
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1300,1800",
    ):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        browser.get(html.as_uri())
        heatmaps = browser.find_elements(By.CSS_SELECTOR, "figure.heatmap svg")
        assert len(heatmaps) == 10  # 7 + the budget curves at compression 0.5, 0.75, 0.9
        for svg in heatmaps:
            assert svg.size["width"] > 40 and svg.size["height"] > 100
            cells = svg.find_elements(By.TAG_NAME, "rect")
            assert len(cells) > 30
            image = Image.open(io.BytesIO(svg.screenshot_as_png)).convert("RGB")
            assert len(_pixels(image)) > 10, "heatmap rendered without its colours"
        curves = browser.find_elements(By.CSS_SELECTOR, "#accuracy-chart polyline.curve")
        assert len(curves) == 2 and all(c.size["width"] > 50 for c in curves)
        chart = Image.open(io.BytesIO(browser.find_element(By.ID, "accuracy-chart").screenshot_as_png)).convert("RGB")
        strokes = {px for px in _pixels(chart) if max(px) - min(px) > 60}  # saturated curve colours
        assert len(strokes) > 5
        assert browser.find_element(By.ID, "identity").text.count("fingerprint") == 3
    finally:
        browser.quit()


def test_a_section_without_its_own_summary_is_summarised_generically(tmp_path):
    """A new stage's section shows in inspect-artifact before anyone writes a summary for it."""
    import json

    from conftest import make_random_artifact

    from artifacts import open_artifact, write_artifact
    from artifacts.summary import format_summary, summarize

    path = write_artifact(tmp_path / "a.h5", make_random_artifact())
    with open_artifact(path) as reader:
        specific = reader.has
        reader.has = lambda name: name != "learned_scorer" and specific(name)  # as if it had no summary code
        summary = summarize(reader)
    generic = summary["sections"]["learned_scorer"]
    assert generic["attrs"]["features"] == "kv" and set(generic["datasets"]) == {
        "weights",
        "bias",
        "ridge",
        "r2",
        "rank_correlation",
    }
    json.dumps(summary)  # --json must work
    assert "learned_scorer" in format_summary(summary) and "rank_correlation" in format_summary(summary)


@pytest.mark.parametrize("sections", [("moments",), ("budgets",), ("recommendation",), ("behaviour", "moments")])
def test_report_of_an_artifact_with_a_subset_of_sections(tmp_path, sections):
    """`profile-model --stages moments` writes an artifact without query_stats: its report must render."""
    path = write_artifact(tmp_path / "subset.h5", make_random_artifact(sections=sections))
    with open_artifact(path) as reader:
        page = render_report(reader)
    assert ('id="served-policies"' in page) == ("recommendation" in sections)
    assert "pre-RoPE queries per head" not in page
