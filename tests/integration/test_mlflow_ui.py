"""The MLflow UI path in a real browser (headless Chromium through Selenium), logged in to MLflow's auth app
(basic auth: the browser sends an Authorization header on every request, set through the DevTools protocol): a
reviewer moves `champion` to an older version with the UI's own alias editor, and serving answers with that
revision within 3 s (MLflow's webhook -> mint's receiver, no reconcile flow running); a viewer's attempt is
refused, the editor shows the error, and neither the alias nor serving changes. The test also opens a version page and the training-runs
link the main job prints, and fails on any 5xx in the MLflow server's log.

Needs Debian's `chromium` and `chromium-driver` (scripts/bootstrap.sh installs them); without them the test
skips, except under CI=true, where it fails.
"""

from __future__ import annotations

import base64
import re
import shutil
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from mlflow import MlflowClient
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service as ChromeService
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

from mint_app.job.report import training_runs_url
from mint_core.registry.runs import log_training_run
from mint_testkit.skips import require
from mint_testkit.waiting import wait_until
from tasks.registry import EXPERIMENT
from tests.integration.alias_stack import BOUND_S, Stack, add_users, alias_stack

pytestmark = pytest.mark.integration

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
HTTP_5XX = re.compile(r'"[A-Z]+ (\S+) HTTP/[\d.]+" (5\d\d)')
UI_WAIT_S = 30.0
COUNT_REQUESTS = """
window.__inflight = 0;
const fetch0 = window.fetch;
window.fetch = function (...args) {
  window.__inflight++;
  return fetch0.apply(this, args).finally(() => { window.__inflight--; });
};
const send0 = XMLHttpRequest.prototype.send;
XMLHttpRequest.prototype.send = function (...args) {
  window.__inflight++;
  this.addEventListener("loadend", () => { window.__inflight--; });
  return send0.apply(this, args);
};
"""
"""Counts the page's requests in flight (`window.__inflight`), in every document the browser opens."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with alias_stack(tmp_path_factory.mktemp("ui")) as s:
        # one training run in the lifecycle's experiment, as the lifecycle logs it
        log_training_run(
            s.ws.registry().client,
            EXPERIMENT,
            s.policy,
            "k" * 24,
            {"steps": 3},
            [{"reward": 0.1}, {"reward": 0.4}],
        )
        yield s


@pytest.fixture(scope="module")
def passwords(stack: Stack) -> dict[str, str]:
    """A reviewer of the stack's policy and a viewer, in the access file and MLflow."""
    return add_users(stack, {"rita": ("reviewer", [stack.policy]), "vera": ("viewer", [])})


def login(driver: WebDriver, user: str, password: str) -> None:
    """Every request the browser sends from now on carries this basic-auth login."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {token}"}})


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    require(
        CHROMIUM is not None and CHROMEDRIVER is not None,
        "chromium / chromedriver not installed (scripts/bootstrap.sh installs them: apt-get install chromium "
        "chromium-driver)",
    )
    assert CHROMIUM is not None and CHROMEDRIVER is not None
    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=ChromeService(CHROMEDRIVER), options=options)
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": COUNT_REQUESTS})
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver: WebDriver, what: str, find: object, timeout: float = UI_WAIT_S) -> object:
    """`find(driver)` once it returns something truthy; a TimeoutException naming `what` and the page text."""
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.1).until(find)  # type: ignore[arg-type]
    except Exception as e:
        text = driver.find_element(By.TAG_NAME, "body").text[:1500]
        raise AssertionError(f"{what} not found in {timeout} s at {driver.current_url}:\n{text}") from e


def version_row(driver: WebDriver, version: int) -> WebElement | None:
    rows = driver.find_elements(By.CSS_SELECTOR, '[data-testid="model-version-table"] [role="row"]')
    return next((r for r in rows if r.text.startswith(f"Version {version}\n")), None)


def logged_settled(browser: WebDriver, stack: Stack) -> None:
    """Until the page has no request in flight and MLflow's log holds every answer it sent: a marker request,
    sent after the page's were answered, is in the log."""
    wait_until(
        lambda: browser.execute_script("return window.__inflight") == 0, UI_WAIT_S, "the page's requests"
    )
    marker = f"/health?after-page={uuid.uuid4().hex}"
    httpx.get(stack.mlflow + marker, timeout=30)
    log = stack.config.state_dir / "mlflow.log"
    wait_until(
        lambda: marker in log.read_text(errors="replace"), UI_WAIT_S, "the marker request in mlflow.log"
    )


def server_errors(stack: Stack) -> list[str]:
    log = (stack.config.state_dir / "mlflow.log").read_text(errors="replace")
    errors = [line for line in log.splitlines() if HTTP_5XX.search(line)]
    return errors + [line for line in log.splitlines() if "Traceback" in line or "ERROR" in line]


def open_alias_editor(browser: WebDriver, stack: Stack, version: int) -> WebElement:
    """The policy's page (loaded afresh), the alias editor of `version` open and `champion` typed into it."""
    browser.get("about:blank")
    browser.get(f"{stack.mlflow}/#/models/{stack.policy}")
    row = wait_for(browser, f"the row of version {version}", lambda d: version_row(d, version))
    assert isinstance(row, WebElement)
    # the Aliases cell: "Add" when the version has none, a pencil otherwise; both open the alias editor
    row.find_element(By.CSS_SELECTOR, 'button[data-component-id*="modelversiontablealiasescell"]').click()
    title = f"alias for model version {version}"

    def editor_open(d: WebDriver) -> WebElement | None:
        return next((e for e in d.find_elements(By.CSS_SELECTOR, '[role="dialog"]') if title in e.text), None)

    editor = wait_for(browser, "the alias editor", editor_open)
    assert isinstance(editor, WebElement)
    box = editor.find_element(By.CSS_SELECTOR, 'input[role="combobox"]')
    box.send_keys("champion")
    box.send_keys(Keys.ENTER)
    return editor


def test_a_viewers_alias_move_in_the_ui_is_refused_and_serving_stays(
    stack: Stack, browser: WebDriver, passwords: dict[str, str]
) -> None:
    newest, older = max(stack.digests), sorted(stack.digests)[-2]
    MlflowClient(stack.mlflow).set_registered_model_alias(stack.policy, "champion", str(newest))
    stack.wait_served(newest)
    login(browser, "vera", passwords["vera"])
    editor = open_alias_editor(browser, stack, older)
    editor.find_element(
        By.CSS_SELECTOR, 'button[data-component-id="mlflow.edit-aliases-modal.save-button"]'
    ).click()
    # MLflow refused it (403), and the UI shows the refusal
    log = stack.config.state_dir / "mlflow.log"
    wait_until(
        lambda: re.search(
            r'"POST \S*/registered-models/alias HTTP/[\d.]+" 403', log.read_text(errors="replace")
        ),
        UI_WAIT_S,
        "MLflow's 403 to the viewer's alias move in mlflow.log",
    )
    # MLflow 3.17's editor shows that 403 ("Permission denied", not JSON) as INTERNAL_ERROR, and stays open
    wait_for(
        browser, "the editor's error", lambda d: "INTERNAL_ERROR" in editor.text or "denied" in editor.text
    )
    assert MlflowClient(stack.mlflow).get_registered_model(stack.policy).aliases["champion"] == str(newest)
    assert stack.served() == stack.digests[newest]


def test_champion_moved_in_the_ui_alias_editor_is_served_within_seconds(
    stack: Stack, browser: WebDriver, passwords: dict[str, str]
) -> None:
    newest, older = max(stack.digests), sorted(stack.digests)[-2]
    MlflowClient(stack.mlflow).set_registered_model_alias(stack.policy, "champion", str(newest))
    stack.wait_served(newest)
    login(browser, "rita", passwords["rita"])

    browser.get("about:blank")  # a fresh page load, logged in as rita (not a fragment change of the last one)
    browser.get(f"{stack.mlflow}/#/models/{stack.policy}")
    row = wait_for(browser, f"the row of version {older}", lambda d: version_row(d, older))
    assert isinstance(row, WebElement)
    # the Aliases cell: "Add" when the version has none, a pencil otherwise; both open the alias editor
    row.find_element(By.CSS_SELECTOR, 'button[data-component-id*="modelversiontablealiasescell"]').click()
    title = f"alias for model version {older}"

    def editor_open(d: WebDriver) -> WebElement | None:
        return next((e for e in d.find_elements(By.CSS_SELECTOR, '[role="dialog"]') if title in e.text), None)

    editor = wait_for(browser, "the alias editor", editor_open)
    assert isinstance(editor, WebElement)
    box = editor.find_element(By.CSS_SELECTOR, 'input[role="combobox"]')
    box.send_keys("champion")
    box.send_keys(Keys.ENTER)
    # the editor warns that the alias leaves the version holding it
    wait_for(browser, "the reassignment warning", lambda d: f"used on version {newest}" in editor.text)
    save = editor.find_element(
        By.CSS_SELECTOR, 'button[data-component-id="mlflow.edit-aliases-modal.save-button"]'
    )
    t0 = time.perf_counter()
    save.click()
    took = stack.wait_served(older)
    assert took < BOUND_S
    assert MlflowClient(stack.mlflow).get_registered_model(stack.policy).aliases["champion"] == str(older)
    with stack.ws.client() as serving:
        out = serving.complete(stack.policy, "add: 1+1 =", max_tokens=2, temperature=0.0)
    assert str(out["system_fingerprint"]).removeprefix("sha256:") == stack.digests[older].removeprefix(
        "sha256:"
    )
    registry = stack.ws.registry()
    actor = wait_until(
        lambda: next(
            (m.actor for m in registry.history(stack.policy, "champion") if m.to_version == older), None
        ),
        30,
        "the UI's move in the catalog's history",
    )
    assert actor == "rita"  # `mint registry history` names the MLflow user who moved it
    print(f"UI save -> served in {time.perf_counter() - t0:.2f} s")


def test_a_version_page_loads(stack: Stack, browser: WebDriver, passwords: dict[str, str]) -> None:
    login(browser, "vera", passwords["vera"])  # a viewer reads
    version = min(stack.digests)
    browser.get(f"{stack.mlflow}/#/models/{stack.policy}/versions/{version}")
    digest = stack.digests[version].removeprefix("sha256:")
    wait_for(
        browser, "the version's mint.digest tag", lambda d: digest in d.find_element(By.TAG_NAME, "body").text
    )
    body = browser.find_element(By.TAG_NAME, "body").text
    assert f"Version {version}" in body and "mint.base" in body
    logged_settled(browser, stack)  # the page's last requests (the version's artifacts) are in the log
    assert server_errors(stack) == []


def test_the_training_runs_link_opens_the_runs_view(
    stack: Stack, browser: WebDriver, passwords: dict[str, str]
) -> None:
    login(browser, "vera", passwords["vera"])
    url = training_runs_url(stack.ws, stack.mlflow)
    assert re.search(r"/#/experiments/\d+/runs$", url), url
    browser.get(url)
    run_name = f"{stack.policy}-{'k' * 8}"
    wait_for(browser, "the training run", lambda d: run_name in d.find_element(By.TAG_NAME, "body").text)
    body = browser.find_element(By.TAG_NAME, "body").text
    assert EXPERIMENT in body and "Training runs" in body
    assert "/overview" not in browser.current_url  # not MLflow 3's GenAI overview ("Traces 0")
    logged_settled(browser, stack)
    assert server_errors(stack) == []
