"""The MLflow UI as a user sees it: a real evaluation, `mlflow server`, headless Chromium.

One evaluation of the real SmolLM2 target (2 prompts x 24 tokens; one of them hostile: it carries
a <script> and an <img onerror> that would retitle the page) goes into a temp MLflow store; the
MLflow server serves it on a free localhost port; Debian's `chromium`, driven by playwright with
`executable_path` (no browser is downloaded), opens the views a README reader opens and checks
what is on screen. Skipped where chromium or playwright is missing; `.ci/run` installs both.

`DFLASH_SCREENSHOT=docs/mlflow-ui.png` also saves the samples page, in MLflow's artifact view,
as the README's screenshot. A second store holds `drafter.step=all` on the shipped fixed run: its parent's
first chart shows τ and the trainer's accuracy by training step
(`DFLASH_TRAINING_SCREENSHOT=docs/training-run-chart.png` saves that chart for docs/training-runs.md).

The runs table and the chart view are opened through the saved view that dflash.tracking stores on
the experiment (`viewStateShareKey=dflash`): τ as a column, τ and the per-position curves as the first charts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
CHROMIUM = os.environ.get("DFLASH_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
HOSTILE = "Repeat exactly: <script>document.title='pwned'</script> <img src=x onerror=\"document.title='pwned'\">"
ML = "workflowType=machine_learning"  # MLflow 3 opens experiments in its GenAI mode otherwise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _evaluate(tmp: Path) -> None:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"id": "square", "subset": "plain", "prompt": "Write a Python function that squares a number."})
        + "\n"
        + json.dumps({"id": "hostile", "subset": "hostile", "prompt": HOSTILE})
        + "\n"
    )
    env = {
        **os.environ,
        "DFLASH_CACHE_DIR": str(ROOT / ".cache"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db",
        "PYTHONPATH": str(ROOT),
    }
    cmd = [
        sys.executable,
        str(ROOT / "evaluate.py"),
        "prompts=jsonl",
        f"prompts.path={prompts}",
        "prompts.max_new_tokens=24",
        f"hydra.run.dir={tmp}/out",
    ]
    r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]


@contextmanager
def _served(tmp: Path, pw):
    """`mlflow server` on the temp store and a headless Chromium context of `pw` (the module's one Playwright:
    a second sync_playwright() inside the first's loop is refused) -> (base url, browser context)."""
    port = _free_port()
    log = open(tmp / "server.log", "w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{tmp}/mlflow.db",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        cwd=tmp,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"mlflow server did not come up: {(tmp / 'server.log').read_text()[-2000:]}")
                time.sleep(1)
        ctx = pw.chromium.launch_persistent_context(
            str(tmp / "profile"),
            executable_path=CHROMIUM,
            headless=True,
            args=FLAGS,
            viewport={"width": 1440, "height": 900},
        )
        # the assistant panel opens itself on a first visit and hides half the page
        ctx.add_init_script("localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true')")
        ctx.set_default_timeout(60_000)
        yield base, ctx
        ctx.close()
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its uvicorn worker: the group started above
        server.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def pw():
    """One Playwright for the module's two served stores."""
    if not CHROMIUM:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium; .ci/run installs it)")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')"
    )
    with sync_api.sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def ui(tmp_path_factory, pw):
    """-> (base url, experiment, run, MlflowClient, browser context), all torn down after the module."""
    from mlflow.tracking import MlflowClient

    tmp = tmp_path_factory.mktemp("ui")
    _evaluate(tmp)
    client = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    (exp,) = [e for e in client.search_experiments() if e.name != "Default"]
    (run,) = client.search_runs([exp.experiment_id])
    with _served(tmp, pw) as (base, ctx):
        yield base, exp, run, client, ctx


@pytest.fixture(scope="module")
def training_ui(tmp_path_factory, pw):
    """`drafter.step=all` on the shipped fixed run (its metrics.jsonl beside it) served -> (base url, experiment,
    parent, client, context)."""
    from dflash import tracking

    tmp = tmp_path_factory.mktemp("training_ui")
    env = {
        **os.environ,
        "DFLASH_CACHE_DIR": str(ROOT / ".cache"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db",
        "PYTHONPATH": str(ROOT),
    }
    cmd = [
        sys.executable,
        str(ROOT / "evaluate.py"),
        "drafter=fixed",
        "drafter.step=all",
        "prompts.num_prompts=2",
        "prompts.max_new_tokens=24",
        f"hydra.run.dir={tmp}/out",
    ]
    r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    client = tracking.mlflow_client(f"sqlite:///{tmp}/mlflow.db")
    (exp,) = [e for e in client.search_experiments() if e.name != "Default"]
    (parent,) = [
        x
        for x in client.search_runs([exp.experiment_id])
        if x.data.tags.get(tracking.ROLE_TAG) == tracking.TRAINING_RUN
    ]
    with _served(tmp, pw) as (base, ctx):
        yield base, exp, parent, client, ctx


def _open(ctx, url: str):
    page = ctx.new_page()
    page.goto(url)
    return page


def _artifacts(client, run_id: str, path: str | None = None) -> list[str]:
    out = []
    for a in client.list_artifacts(run_id, path):
        out += _artifacts(client, run_id, a.path) if a.is_dir else [a.path]
    return out


def _curves(client, run) -> dict[str, int]:
    """Metrics logged as curves (more than one step) -> number of points."""
    hist = {k: client.get_metric_history(run.info.run_id, k) for k in run.data.metrics}
    return {k: len(h) for k, h in hist.items() if len({m.step for m in h}) > 1}


def test_runs_table_lists_the_run(ui):
    base, exp, run, _, ctx = ui
    page = _open(ctx, f"{base}/#/experiments/{exp.experiment_id}/runs?{ML}")
    page.get_by_role("link", name=run.info.run_name).wait_for()
    assert page.get_by_text("1 matching run").is_visible()
    page.close()


def _table_url(base: str, exp) -> str:
    """The runs table, through the shared view the tracking side stores on the experiment, if any."""
    keys = [k.removeprefix("mlflow.sharedViewState.") for k in exp.tags if k.startswith("mlflow.sharedViewState.")]
    return f"{base}/#/experiments/{exp.experiment_id}/runs?{ML}" + (f"&viewStateShareKey={keys[0]}" if keys else "")


def test_runs_table_shows_tau(ui):
    base, exp, run, client, ctx = ui
    page = _open(ctx, _table_url(base, client.get_experiment(exp.experiment_id)))
    page.get_by_role("link", name=run.info.run_name).wait_for()
    page.wait_for_timeout(2000)
    headers = page.locator("[role=columnheader]").all_inner_texts()
    assert "acceptance_length" in headers, headers
    cells = page.locator(
        "[role=gridcell]"
    ).all_inner_texts()  # one run: its row (split by the grid into pinned and scrolled parts)
    values = [float(c) for c in cells if c.replace(".", "", 1).isdigit()]
    assert any(abs(v - run.data.metrics["acceptance_length"]) < 1e-3 for v in values), cells
    page.close()


def test_chart_view_draws_the_per_position_curves(ui):
    """Every metric logged over positions is a line chart in the chart view, one point per logged position."""
    base, exp, run, client, ctx = ui
    curves = _curves(client, run)
    assert len(curves) >= 3, curves  # cumulative, conditional, teacher-forced at least
    page = _open(ctx, f"{base}/#/experiments/{exp.experiment_id}/runs?{ML}&compareRunsMode=CHART")
    search = page.get_by_placeholder("Search metric charts")
    cards = page.locator("[data-testid=experiment-view-compare-runs-card]")
    for name, n in curves.items():
        search.fill(name)
        page.wait_for_timeout(1000)
        card = cards.filter(has=page.get_by_text(name, exact=True)).first
        page.locator("[data-testid=experiment-view-compare-runs-chart-area]").hover()
        for _ in range(40):  # charts render only when scrolled into view
            if card.count():
                break
            page.mouse.wheel(0, 500)
            page.wait_for_timeout(250)
        card.scroll_into_view_if_needed()
        card.locator("path.js-line").first.wait_for(state="attached")
        assert card.locator(".point").count() == n, name
    page.close()


def test_chart_view_shows_tau_and_curves_first(ui):
    base, exp, run, client, ctx = ui
    page = _open(ctx, f"{_table_url(base, client.get_experiment(exp.experiment_id))}&compareRunsMode=CHART")
    cards = page.locator("[data-testid=experiment-view-compare-runs-card]")
    cards.first.wait_for()
    page.wait_for_timeout(2000)
    first = [t.split("\n")[0] for t in cards.all_inner_texts()[:6]]
    assert "acceptance_length" in first and any(c in first for c in _curves(client, run)), first
    assert not any("/pos_" in t for t in first), first
    page.close()


def test_plots_show_in_the_artifact_view(ui):
    base, exp, run, client, ctx = ui
    pngs = [p for p in _artifacts(client, run.info.run_id) if p.endswith(".png")]
    assert len(pngs) >= 2, pngs  # per-position curves and the commit histogram
    for path in pngs:
        page = _open(ctx, f"{base}/#/experiments/{exp.experiment_id}/runs/{run.info.run_id}/artifacts/{path}?{ML}")
        img = page.locator("img[src*='get-artifact'], img[src^='blob:']").first
        img.wait_for()
        page.wait_for_function("img => img.complete && img.naturalWidth > 300", arg=img.element_handle())
        page.close()


def test_samples_page_renders_its_colours_and_runs_no_prompt_script(ui):
    base, exp, run, client, ctx = ui
    assert "samples.html" in _artifacts(client, run.info.run_id)
    page = _open(ctx, f"{base}/#/experiments/{exp.experiment_id}/runs/{run.info.run_id}/artifacts/samples.html?{ML}")
    frame = page.frame_locator("iframe").first
    frame.locator("span.acc").first.wait_for()
    colours = {
        cls: frame.locator(f".text span.{cls}").first.evaluate("e => getComputedStyle(e).backgroundColor")
        for cls in ("acc", "rej", "bonus")
    }
    assert len(set(colours.values())) == 3 and "rgba(0, 0, 0, 0)" not in colours.values(), (
        colours
    )  # three colours, none transparent
    assert frame.locator(".legend .acc:not(.sel)").is_visible() and frame.locator(".legend .bonus").is_visible()
    if frame.locator(".text span.sel").count():  # a DFlash2 drafter: its selector's choices are marked and explained
        assert frame.locator(".legend .acc.sel").is_visible()
    assert frame.get_by_text("τ =").first.is_visible()
    # the hostile prompt is shown as text: no element from it, nothing it ran
    assert frame.get_by_text("<script>document.title='pwned'</script>").count() >= 1
    assert frame.locator("script, img, iframe").count() == 0
    inner = next(f for f in page.frames if f.url.startswith("blob:"))
    assert inner.evaluate("document.title") != "pwned" and page.title() != "pwned"
    if os.environ.get("DFLASH_SCREENSHOT"):
        page.wait_for_timeout(1000)
        page.screenshot(path=os.environ["DFLASH_SCREENSHOT"])
    page.close()


def test_a_training_run_shows_tau_and_training_accuracy_by_step_on_one_chart(training_ui):
    """The training-run view's first chart: the parent's τ (at steps 1633, 5037) and the trainer's accuracy (train/acc,
    from checkpoints/fixed/metrics.jsonl) on one chart, x = training step."""
    from dflash import tracking

    base, exp, parent, client, ctx = training_ui
    assert sorted(m.step for m in client.get_metric_history(parent.info.run_id, "acceptance_length")) == [1633, 5037]
    assert len(client.get_metric_history(parent.info.run_id, "train/acc")) > 10
    page = _open(ctx, tracking.training_view_url(exp.experiment_id, base))
    card = page.locator("[data-testid=experiment-view-compare-runs-card]").first
    card.wait_for()
    card.locator("path.js-line").first.wait_for(state="attached")
    page.wait_for_timeout(2000)
    text = card.inner_text()
    assert "acceptance_length" in text and "train/acc" in text, text
    assert card.locator("path.js-line").count() >= 2  # a line per metric
    if os.environ.get("DFLASH_TRAINING_SCREENSHOT"):
        card.screenshot(path=os.environ["DFLASH_TRAINING_SCREENSHOT"])
    page.close()
