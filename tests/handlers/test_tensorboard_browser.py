"""In a real browser (headless Chromium through chromedriver; skipped without them): the dashboard the CLI
points to and the Time Series tab, read from the rendered page. Each chart with several lines has a legend
whose colours differ, one quantity per run (so one colour is one quantity), and the validation line is
drawn. Screenshots go to $IGNITE_AMP_SHOTS when set (else the test's temporary directory)."""
import io
import os
import re
import time

import pytest

from helpers.tensorboard import serve_tensorboard
from ignite_amp import train_from_config
from ignite_amp.cli.commands import _dashboard_hint
from ignite_amp.files.run_directory import dashboard_command

DEEP = """const all = (root, sel, out = []) => { for (const el of root.querySelectorAll('*')) {
    if (el.matches(sel)) out.push(el); if (el.shadowRoot) all(el.shadowRoot, sel, out); } return out; };"""

CARDS = DEEP + """
return all(document, 'tf-custom-scalar-multi-line-chart-card').map(card => ({
  title: card.title,
  legend: Array.from(card.shadowRoot.querySelectorAll('.match-list-entry')).map(
      e => [e.textContent.replace('\u25fc', '').trim(), e.style.color]),
  lines: all(card.shadowRoot, 'path.line').filter(p => p.getAttribute('d')).map(p => ({
      stroke: p.getAttribute('stroke') || p.style.stroke, height: p.closest('svg').getBoundingClientRect().height,
      ys: (p.getAttribute('d').match(/-?[\\d.]+(e-?\\d+)?,-?[\\d.]+(e-?\\d+)?/g) || []).map(\
xy => +xy.split(',')[1])}))}));"""


def rgb(color: str) -> tuple:
    if color.startswith("#"):
        return tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))
    return tuple(int(v) for v in re.findall(r"\d+", color)[:3])


@pytest.fixture
def three_epochs(quick_cfg, tmp_path):
    """A 3-epoch CPU run (3 validation points) under tmp/runs/quick, served by TensorBoard."""
    runs = tmp_path / "runs"
    cfg = dict(quick_cfg, name="quick", output_dir=str(runs / "quick"), train={"epochs": 3},
               amp={"dtype": "bfloat16"}, data=dict(quick_cfg["data"], train_size=256, val_size=32),
               handlers={"tensorboard": {"log_every": 2}, "clipping": {"max_norm": 1.0}})
    result = train_from_config(cfg, print_fn=lambda *a: None)
    with serve_tensorboard(dashboard_command(result["tensorboard_dir"]), {"train", "val"}) as base:  # as printed
        yield base, result


def shots(tmp_path):
    folder = os.environ.get("IGNITE_AMP_SHOTS") or str(tmp_path)
    os.makedirs(folder, exist_ok=True)
    return folder


def cropped(cards) -> list:
    """(chart, stroke) of each line with a point outside its chart (TensorBoard clips it)."""
    return [(c["title"], line["stroke"]) for c in cards for line in c["lines"]
            if any(y < -1 or y > line["height"] + 1 for y in line["ys"])]


@pytest.mark.slow
def test_the_printed_dashboard_tells_train_from_val_by_colour_and_legend(three_epochs, browser, tmp_path):
    base, result = three_epochs
    hint = _dashboard_hint(result["tensorboard_dir"])
    url = re.search(r"http://localhost:6006/(\S+)", hint).group(1)
    browser.open(f"{base}/{url}")
    cards = browser.wait_for(CARDS.replace("return all(", "const cards = all(") +
                             "\nreturn cards.length && cards.every(c => c.lines.length) ? cards : null;")
    assert cards, "the dashboard drew no chart"
    folder = shots(tmp_path)
    browser.screenshot(os.path.join(folder, "1_dashboard_as_opened.png"))
    print("lines cropped with TensorBoard's default scaling:", cropped(cards))
    # TensorBoard 2.21 ignores outliers in chart scaling by default and reads that setting from no URL
    # parameter: the TensorBoard guide (docs/guides/tensorboard.md) asks for one click, which this makes;
    # then no line leaves its chart.
    browser.js(DEEP + """for (const box of all(document, 'paper-checkbox'))
        if (box.textContent.includes('Ignore outliers')) { if (box.checked) box.click(); }""")
    browser.js(DEEP + "for (const b of all(document, '.toggle-matches-button')) b.click();")  # open the legends
    time.sleep(2)
    cards = browser.js(CARDS)
    browser.screenshot(os.path.join(folder, "2_dashboard_outliers_kept_legends_open.png"))
    assert cropped(cards) == []
    for card in cards:
        labels = [label for label, _ in card["legend"]]
        runs = [re.search(r"\((.*)\)$", label).group(1) for label in labels]
        assert len(runs) == len(set(runs)), card["title"]  # one quantity per run: one per colour
        colours = {rgb(colour) for _, colour in card["legend"]}
        assert len(colours) == len(labels), card["title"]  # the legend tells the lines apart
        # Each legend entry's line is drawn, in its colour; validation lines have their 3 points.
        for label, colour in card["legend"]:
            drawn = [line for line in card["lines"] if rgb(line["stroke"]) == rgb(colour)]
            assert drawn and len(drawn[0]["ys"]) >= (3 if "(val)" in label else 1), (card["title"], label)
    by_title = {c["title"]: c for c in cards}
    loss = by_title["loss: train (window mean), val"]
    assert sorted(label for label, _ in loss["legend"]) == ["loss (train)", "loss (val)"]


TIME_SERIES_CARD = """
const cards = Array.from(document.querySelectorAll('scalar-card'));  // only those near the view exist
const card = cards.find(c => (c.querySelector('.heading') || {textContent: ''}).textContent.trim() === arguments[0]);
if (!card) { if (cards.length) cards[cards.length - 1].scrollIntoView({block: 'start'}); return null; }
card.scrollIntoView({block: 'center'});
const canvas = card.querySelector('canvas');
const rows = Array.from(card.querySelectorAll('tb-data-table-content-row')).map(row => [
    (row.textContent.match(/\\b(train|val)\\b/) || [''])[0],
    (row.querySelector('.row-circle span') || {style: {}}).style.backgroundColor]);
if (!canvas || !rows.length) return null;
const r = canvas.getBoundingClientRect();
return {rows: rows, box: [r.left, r.top, r.right, r.bottom], ratio: window.devicePixelRatio};"""


def pixels_of(png: bytes, box, ratio: float, colour: tuple) -> int:
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    left, top, right, bottom = (int(v * ratio) for v in box)
    region = image.crop((left, top, right, bottom))
    data = region.tobytes()
    return sum(1 for i in range(0, len(data), 3) if all(abs(data[i + k] - colour[k]) <= 40 for k in range(3)))


@pytest.mark.slow
@pytest.mark.parametrize("tag", ["loss", "accuracy"])
def test_time_series_draws_the_validation_line_in_its_own_colour(three_epochs, browser, tmp_path, tag):
    pytest.importorskip("PIL")
    base, _ = three_epochs
    browser.open(f"{base}/?smoothing=0#timeseries")
    card = browser.wait_for(TIME_SERIES_CARD, 60, tag)
    assert card, f"no {tag} card with its data table"
    time.sleep(2)  # the chart draws after the scroll
    card = browser.js(TIME_SERIES_CARD, tag)
    png = browser.screenshot(os.path.join(shots(tmp_path), f"3_time_series_{tag}.png"))
    colours = {run: rgb(colour) for run, colour in card["rows"]}
    assert len(set(colours.values())) == len(colours), colours  # the table under the card is its legend
    assert "val" in colours and (tag != "loss" or "train" in colours), colours
    for run, colour in colours.items():
        assert pixels_of(png, card["box"], card["ratio"], colour) >= 20, (tag, run)  # the line is drawn


HPARAMS_TABLE = DEEP + """
const grid = all(document, 'vaadin-grid').find(g => g.items && g.items.length);
if (!grid) return null;
const cells = all(document, '.table-cell').map(c => c.textContent.trim()).filter(t => t);
const header = cells.indexOf('Trial ID');
return header < 0 ? null : cells.slice(header);"""


@pytest.mark.slow
def test_the_hparams_table_names_the_run_and_fills_every_column(three_epochs, browser, tmp_path):
    """Under the printed command (the run alone, TensorBoard's session "."): the row is named after the run,
    the batch size reads as written, and the metric columns are filled."""
    base, result = three_epochs
    browser.open(f"{base}/#hparams")
    cells = browser.wait_for(HPARAMS_TABLE, 60)
    assert cells, "no HParams table"
    browser.screenshot(os.path.join(shots(tmp_path), "4_hparams_table.png"))
    titles = ["val accuracy (final)", "val accuracy (best)", "val loss (final)", "val loss (best)",
              "samples/s (median)"]
    columns = cells[:cells.index(titles[-1]) + 1]
    assert columns[:2] == ["Trial ID", "Show Metrics"] and columns[-5:] == titles
    row = dict(zip([c for c in columns if c != "Show Metrics"], cells[len(columns):], strict=True))
    assert row["Trial ID"].startswith("quick 20")  # not "."
    assert row["batch_size"] == "32"  # not "32.000"
    assert float(row["val accuracy (final)"]) == pytest.approx(result["final"]["val_accuracy"], abs=1e-4)
    assert float(row["samples/s (median)"]) > 0 and all(row[t] for t in titles)
