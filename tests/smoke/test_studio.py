"""Smoke: ``rftstream studio`` in headless Chromium (Debian's ``chromium`` + ``chromium-driver``).

The studio runs as a user starts it (``rftstream studio --port 0``, a subprocess);
selenium drives Debian's chromium. Screenshots go under the test's tmp dir and are
checked for content: the page's text through the DOM, and pixels that are not blank.
A config made through the form is saved by the page, loaded with ``load_config`` and
run for 2 steps by the page's Run button (the studio starts ``rftstream up`` against a
real nats-server), whose run the live view then shows (stages, heartbeats, curves, the
reward smoothed, a dead letter). A longer run started the same way is stopped by the
Stop button: SIGINT, a clean shutdown, ``run.lock`` saying ``stopped``.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest

from rftstream.config import load_config
from tests.integration._util import user_env

pytestmark = pytest.mark.smoke

RFTSTREAM = [sys.executable, "-m", "rftstream.cli"]
CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
NO_BROWSER = (
    "needs Debian's chromium and chromium-driver (`apt-get install -y chromium chromium-driver`; "
    "`just setup` installs them when run as root) and the selenium package (test extra)"
)

try:
    import selenium  # noqa: F401

    HAVE_SELENIUM = True
except ImportError:
    HAVE_SELENIUM = False

needs_browser = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER and HAVE_SELENIUM), reason=NO_BROWSER
)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium for the module's tests."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,1800",
    ):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _start_studio(nats_url: str, log: Path, env: dict[str, str] | None = None) -> tuple[Any, str]:
    """``rftstream studio --port 0`` in a subprocess; (process, base URL) once it listens."""
    out = open(log, "w")
    proc = subprocess.Popen(
        [*RFTSTREAM, "studio", "--port", "0", "--nats-url", nats_url],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
    )
    deadline = time.time() + 60
    while time.time() < deadline:
        m = re.search(r"rftstream studio on (http://\S+/)", log.read_text())
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            raise AssertionError(log.read_text())
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"studio did not start within 60 s: {log.read_text()}")


@pytest.fixture
def studio(nats_url: str, tmp_path: Path, tiny_model_path: str) -> Iterator[str]:
    """The studio on the test's nats-server."""
    yield from _studio(nats_url, tmp_path, tiny_model_path)


@pytest.fixture
def studio_without_nats(tmp_path: Path, tiny_model_path: str) -> Iterator[str]:
    """The studio with nothing listening at its NATS URL: a run it starts gets the
    embedded server of its ``up``."""
    from rftstream.nats_server.embedded import free_port

    yield from _studio(f"nats://127.0.0.1:{free_port()}", tmp_path, tiny_model_path)


def _studio(nats_url: str, tmp_path: Path, tiny_model_path: str) -> Iterator[str]:
    """The studio in a user's shell (the tiny model's cache: runs it starts find it);
    stopped as with Ctrl-C, which stops a run it started (SIGINT) and waits for it."""
    log = tmp_path / "studio.log"
    proc, url = _start_studio(nats_url, log, env=user_env(tiny_model_path))
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(
                f"the studio did not stop on SIGINT: {log.read_text()[-3000:]}"
            ) from None


def _wait(driver: Any, condition: Any, timeout: float = 20, what: str = "") -> Any:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # the live view re-renders its tables on every poll: an element found a moment ago
    # may be gone, which is not a failed condition (it is asked again)
    ignored = (NoSuchElementException, StaleElementReferenceException)
    wait = WebDriverWait(driver, timeout, poll_frequency=0.2, ignored_exceptions=ignored)
    return wait.until(_asked_again_across_navigation(condition), message=what)


# chromedriver's words when a page navigates while a condition reads the old document
# (Run's redirect to the live view): the element's node or the script's context is gone
_NAVIGATED_AWAY = (
    "does not belong to the document",
    "Execution context was destroyed",
    "Cannot find context with specified id",
    "Inspected target navigated or closed",
)


def _asked_again_across_navigation(condition: Any) -> Any:
    """The condition, read as not yet true when the page navigated under it.

    Only chromedriver's navigation errors are swallowed; any other WebDriver error, and
    an AssertionError the condition raises, still fail the wait at once."""
    from selenium.common.exceptions import WebDriverException

    def asked(driver: Any) -> Any:
        try:
            return condition(driver)
        except WebDriverException as exc:
            if any(words in str(exc.msg) for words in _NAVIGATED_AWAY):
                return False
            raise

    return asked


def _screenshot(driver: Any, path: Path) -> None:
    """Save a screenshot and check it is not blank: several colours, and a real share of
    pixels differing from the most common (background) colour."""
    from PIL import Image

    assert driver.save_screenshot(str(path)), path
    img = Image.open(path).convert("RGB")
    counts = img.getcolors(maxcolors=img.width * img.height)
    assert counts is not None
    counts.sort(reverse=True)
    background = counts[0][0]
    share = 1 - background / (img.width * img.height)
    assert len(counts) > 20, f"{path}: {len(counts)} colours: blank page"
    assert share > 0.02, f"{path}: only {share:.1%} of the pixels are not background"


def _field(driver: Any, path: str) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, f'.field[data-path="{path}"]')


def _set(driver: Any, path: str, value: str) -> None:
    from selenium.webdriver.common.by import By

    el = _field(driver, path).find_element(By.CSS_SELECTOR, "input, select, textarea")
    if el.tag_name == "select":
        from selenium.webdriver.support.ui import Select

        Select(el).select_by_value(value)
        return
    driver.execute_script(
        "arguments[0].closest('details') && (arguments[0].closest('details').open = true)", el
    )
    el.clear()
    el.send_keys(value)


def _open_config_page(driver: Any, url: str) -> None:
    driver.get(url)
    _wait(driver, lambda d: d.execute_script("return document.body.dataset.ready"), what="schema")


@needs_browser
def test_config_page_shows_the_schema_and_field_errors(
    browser: Any, studio: str, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    _open_config_page(browser, studio)
    text = browser.find_element(By.TAG_NAME, "body").text
    for title in ("Algorithm", "Buffer and taskset", "Explorer", "Synchronizer", "Trainer"):
        assert title in text
    assert "Operators (experience pipeline)" in text and "advanced (" in text
    assert "buffer.explorer_input.taskset.path" in text  # a common key, shown
    # section descriptions: docstring markup shown as text and <code>, never as markup
    helps = " ".join(h.text for h in browser.find_elements(By.CLASS_NAME, "section-help"))
    assert "model_path" in helps and "batch sizes" in helps
    for markup in ("``", ":class:", ":mod:", ":func:", ":meth:", "`"):
        assert markup not in helps, markup
    tags = browser.execute_script(
        "return [...document.querySelectorAll('.section-help *')].map((e) => e.tagName)"
    )
    assert tags and set(tags) == {"CODE"}  # nothing else made from docstring text
    sync_codes = [
        c.text for c in browser.find_elements(By.CSS_SELECTOR, "#section-synchronizer code")
    ]
    # <RUN> is text (not an HTML tag), a :mod: role its module's name
    assert "RFT_<RUN>_WEIGHTS" in sync_codes and "rftstream.weights" in sync_codes
    model_codes = [c.text for c in browser.find_elements(By.CSS_SELECTOR, "#section-model code")]
    assert "LoRAConfig" in model_codes  # :class:`LoRAConfig`
    _screenshot(browser, tmp_path / "config.png")

    _set(browser, "buffer.batch_size", "0")
    _set(browser, "explorer.runner_num", "x")
    browser.find_element(By.ID, "check").click()
    _wait(browser, lambda d: "error" in d.find_element(By.ID, "status").text, what="checked")
    batch = _field(browser, "buffer.batch_size")
    assert "has-error" in batch.get_attribute("class")
    # the loader's message, next to the field
    assert "must be >= 1 (got 0)" in batch.find_element(By.CLASS_NAME, "error").text
    runners = _field(browser, "explorer.runner_num").find_element(By.CLASS_NAME, "error").text
    assert runners == "must be an integer"
    # a key with a closed set of values (a Literal in the schema) is a select of exactly those
    from selenium.webdriver.support.ui import Select

    zero = Select(_field(browser, "trainer.zero_stage").find_element(By.TAG_NAME, "select"))
    assert [o.get_attribute("value") for o in zero.options] == ["0", "1", "2", "3"]
    assert not browser.find_element(By.ID, "download").is_displayed()
    _screenshot(browser, tmp_path / "config-errors.png")


async def _dead_letter(url: str, run: str) -> None:
    """One dead letter on the run's DLQ subject, as an actor writes it (reason in headers)."""
    nc = await nats.connect(url)
    try:
        await nc.jetstream().publish(
            f"rft.{run}.dlq.train",
            b"not an experience",
            headers={
                "Rft-Dlq-Reason": "token id 100003 is outside the vocabulary (64)",
                "Rft-Dlq-Stage": "train",
                "Rft-Dlq-Actor": "trainer",
            },
        )
    finally:
        await nc.close()


async def _live_json(base: str, run: str) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}api/runs/{run}") as resp:
            return await resp.json()


def _fill_run_config(driver: Any, run_dir: Path, tiny_model_path: str, name: str) -> None:
    """The form set to a small run of the tiny model (2 tasks x 4 rollouts per step)."""
    for path, value in {
        "name": name,
        "run_dir": str(run_dir),
        "model.model_path": tiny_model_path,
        "model.max_response_tokens": "6",
        "algorithm.repeat_times": "4",
        "algorithm.optimizer.lr": "0.001",
        "buffer.batch_size": "2",
        "buffer.total_epochs": "5",
        "buffer.explorer_input.taskset.rollout_args.max_tokens": "6",
        "explorer.runner_num": "2",
        "trainer.ppo_micro_batch_size_per_gpu": "4",
    }.items():
        _set(driver, path, value)
    _set(driver, "synchronizer.sync_style", "dynamic_by_explorer")


def _launch(driver: Any) -> dict[str, Any]:
    """The launch panel's state, read in one script (it is re-rendered every 2 s)."""
    return driver.execute_script(
        "const l = document.getElementById('launch');"
        "return {hidden: l.hidden, state: l.dataset.state, outcome: l.dataset.outcome,"
        " code: l.dataset.exitCode, run: l.dataset.run, text: l.innerText,"
        " tail: (document.getElementById('launch-tail') || {}).textContent};"
    )


def _click_run(driver: Any, run: str) -> None:
    """Press Run and wait for the page to become the run's live view."""
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "run").click()

    def on_live_view(d: Any) -> bool:
        # one script, so the three texts come from one document (Run navigates away)
        page = d.execute_script(
            "const t = id => (document.getElementById(id) || {}).textContent || '';"
            "return {url: location.href, error: t('launch-error'),"
            " general: t('general-errors'), status: t('status')};"
        )
        if page["url"].endswith(f"/live?run={run}"):
            return True
        if page["error"] or page["general"]:
            raise AssertionError(f"Run refused: {page['error']} {page['general']} {page['status']}")
        return False

    _wait(driver, on_live_view, timeout=60, what="the live view of the started run")
    _wait(driver, lambda d: _launch(d)["run"] == run, what="the launch panel")


def _lock_status(run_dir: Path) -> str:
    """The status the run dir's ``run.lock`` record holds."""
    from rftstream.run_lock import last_owner

    owner = last_owner(run_dir)
    assert owner is not None, f"no run.lock record in {run_dir}"
    return owner.status


@needs_browser
def test_a_form_config_runs_two_steps_and_the_live_view_shows_it(
    browser: Any, studio: str, nats_url: str, tmp_path: Path, tiny_model_path: str
) -> None:
    from selenium.webdriver.common.by import By

    run_dir = tmp_path / "run"
    _open_config_page(browser, studio)
    _fill_run_config(browser, run_dir, tiny_model_path, "studio-run")
    _set(browser, "buffer.total_steps", "2")
    saved = tmp_path / "studio.yaml"
    browser.find_element(By.ID, "save-path").send_keys(str(saved))
    browser.find_element(By.ID, "save").click()
    _wait(browser, lambda d: d.find_element(By.ID, "saved").text, what="saved")
    assert browser.find_element(By.ID, "saved").text == f"saved {saved}"
    assert browser.find_element(By.ID, "status").text == "valid"
    assert browser.find_element(By.ID, "download").is_displayed()
    assert "name: studio-run" in browser.find_element(By.ID, "yaml").text

    cfg = load_config(saved)
    assert cfg.name == "studio-run" and cfg.buffer.batch_size == 2
    assert cfg.algorithm.repeat_times == 4 and cfg.algorithm.optimizer.lr == 0.001
    assert cfg.model.model_path == tiny_model_path and cfg.run_dir == str(run_dir)
    assert cfg.buffer.total_steps == 2

    # Run: the studio starts `rftstream up` on the checked config, the page its live view
    run = "studio_run"  # run id of the name
    assert _launch(browser)["hidden"] is True  # no run started yet: no panel
    _click_run(browser, run)
    panel = _launch(browser)
    assert panel["state"] in ("running", "exited"), panel
    assert f"run dir: {run_dir}" in panel["text"]
    assert f"the studio's NATS server ({nats_url})" in panel["text"]  # up --nats-url

    def actors_beating(d: Any) -> bool:
        state = _launch(d)
        if state["outcome"] == "failed":
            raise AssertionError(state["tail"])
        # read in one script: the rows are replaced on every poll of the live view
        roles = d.execute_script(
            "return [...document.querySelectorAll('#heartbeats tbody tr')]"
            ".map((r) => r.cells[1] ? r.cells[1].textContent : '')"
        )
        return {"explorer", "trainer"} <= set(roles)

    # heartbeats stay in the KV bucket after the run: seen while it runs or after it
    _wait(browser, actors_beating, timeout=120, what="explorer and trainer heartbeats")
    stages = browser.find_element(By.ID, "stages").text
    assert f"rft.{run}.exp.raw" in stages and f"RFT_{run.upper()}_EXP" in stages
    consumers = browser.find_element(By.ID, "consumers").text
    assert "trainer" in consumers
    _screenshot(browser, tmp_path / "live-running.png")

    _wait(browser, lambda d: _launch(d)["state"] == "exited", timeout=180, what="up exited")
    panel = _launch(browser)
    assert (panel["outcome"], panel["code"]) == ("finished", "0"), panel["tail"]
    assert "finished (exit code 0)" in panel["text"] and "run.lock status: done" in panel["text"]
    assert _lock_status(run_dir) == "done"

    anyio.run(_dead_letter, nats_url, run)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    snapshot = anyio.run(_live_json, studio, run)
    assert snapshot["ok"] and snapshot["status_value"] == "finished"
    # the curves read from the metrics stream are the trainer's step records; a step whose
    # record has no value has no point (reward/mean: no raw group arrived since the step
    # before, as when the explorer published step 2's groups before step 1's record)
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["reward/mean"] is not None and records[1]["staleness/mean"] is not None
    for key in ("reward/mean", "staleness/mean"):
        curve = snapshot["curves"][key]
        expected = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        assert [step for step, _ in curve] == [step for step, _ in expected], key
        assert [value for _, value in curve] == pytest.approx([v for _, v in expected]), key
    reward_steps = len(snapshot["curves"]["reward/mean"])
    smooth = snapshot["smoothed"]["reward/mean"]  # metrics.png's EMA: span 1 for 2 steps
    assert smooth["span"] == 1 and smooth["points"] == snapshot["curves"]["reward/mean"]

    def finished(d: Any) -> bool:
        return (
            "finished" in d.find_element(By.ID, "cards").text
            and "(1)" in d.find_element(By.ID, "dlq-count").text
        )

    _wait(browser, finished, timeout=10, what="the finished run with its dead letter")
    cards = browser.find_element(By.ID, "cards").text
    assert "2\ntrainer step" in cards
    charts = browser.find_element(By.ID, "charts").text
    assert "reward" in charts and f"({reward_steps} steps, raw)" in charts
    assert "(2 steps)" in charts
    # the reward drawn raw (faint) and smoothed, the staleness raw
    lines = browser.execute_script(
        "return [...document.querySelectorAll('#charts polyline')]"
        ".map((l) => [l.getAttribute('class'), l.getAttribute('stroke-opacity')])"
    )
    assert sorted(lines) == sorted([["raw", "0.25"], ["smoothed", "1"], ["raw", "1"]])
    dead = browser.find_element(By.ID, "dead-letters").text
    assert "outside the vocabulary" in dead and "trainer" in dead
    _screenshot(browser, tmp_path / "live-finished.png")

    # back on the config page, the finished run's panel is shown; Run is free again
    _open_config_page(browser, studio)
    _wait(browser, lambda d: _launch(d)["state"] == "exited", what="the launch panel")
    assert not browser.find_element(By.ID, "stop").is_displayed()


@needs_browser
def test_stop_ends_a_longer_run_cleanly(
    browser: Any, studio_without_nats: str, tmp_path: Path, tiny_model_path: str
) -> None:
    """Stop on a run whose ``up`` started its own embedded server (the studio has none):
    the live view reads it there while it runs; Stop is a clean SIGINT."""
    from selenium.webdriver.common.by import By

    run_dir = tmp_path / "run"
    _open_config_page(browser, studio_without_nats)
    _fill_run_config(browser, run_dir, tiny_model_path, "studio-stop")
    _set(browser, "buffer.total_steps", "1000")
    _set(browser, "buffer.total_epochs", "1000")
    run = "studio_stop"
    _click_run(browser, run)
    assert "rftstream up starts its own in the run dir" in _launch(browser)["text"]

    def trained(d: Any) -> bool:
        state = _launch(d)
        if state["state"] == "exited":
            raise AssertionError(f"up exited before Stop: {state['tail']}")
        step = d.execute_script(
            "const c = [...document.querySelectorAll('#cards .card')]"
            ".find((c) => c.querySelector('.k').textContent === 'trainer step');"
            "return c ? c.querySelector('.v').textContent : null"
        )
        return step not in (None, "–", "0")

    _wait(browser, trained, timeout=180, what="a trainer step")
    assert _lock_status(run_dir) == "running"
    browser.find_element(By.ID, "stop").click()
    _wait(
        browser,
        lambda d: _launch(d)["state"] in ("stopping", "exited"),
        timeout=10,
        what="stopping",
    )
    _screenshot(browser, tmp_path / "live-stopping.png")
    _wait(browser, lambda d: _launch(d)["state"] == "exited", timeout=120, what="up exited")
    panel = _launch(browser)
    # SIGINT: a clean stop (130; 0 when it came as the run was ending anyway)
    assert panel["code"] in ("130", "0"), panel["tail"]
    status = _lock_status(run_dir)
    assert status != "running" and status == ("stopped" if panel["code"] == "130" else "done")
    if panel["code"] == "130":
        assert "stopped (exit code 130)" in panel["text"]
        # how to continue it: the same config and run dir
        assert f"--run-dir {run_dir}" in panel["text"] and "continue it later" in panel["text"]
    _screenshot(browser, tmp_path / "live-stopped.png")
