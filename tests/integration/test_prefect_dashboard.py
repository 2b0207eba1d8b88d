"""The Prefect dashboard in a real browser (headless Chromium through Selenium): the server asks its auth string,
so the dashboard opens on its login prompt and shows nothing before the string is given there (a wrong one is
refused); after the deployments are registered as `mint up` registers them, its Deployments page lists every
mint deployment, and a deployment's Run -> Quick run creates a flow run of it (what a data scientist clicks)."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
from prefect.client.schemas.objects import FlowRun
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service as ChromeService
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

from mint_app.services.config import ServicesConfig
from mint_app.services.deployments import register_deployments
from mint_testkit.skips import require

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
FLOWS = ("wave", "lifecycle", "promote", "rollback", "reconcile", "retrain", "prefetch", "canary", "route")
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    found = Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()
    require(found or bool(shutil.which("chromium")), "Debian chromium + chromium-driver are not installed")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=ChromeService(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def registered(prefect_server: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """infra/prefect.yaml registered on the session's Prefect server through mint_app.services.control (a pool of this
    module's own, no schedules, no worker); the dashboard's root URL."""
    root = tmp_path_factory.mktemp("dashboard")
    spec = yaml.safe_load((ROOT / "infra" / "prefect.yaml").read_text())
    pool = f"mint-ui-{uuid.uuid4().hex[:8]}"
    for d in spec["deployments"]:
        d["work_pool"] = {**d["work_pool"], "name": pool}
        d.pop("schedules", None)
    (root / "prefect.yaml").write_text(yaml.safe_dump(spec))
    port = int(prefect_server.removesuffix("/api").rsplit(":", 1)[1])
    config = ServicesConfig.model_validate(
        {"state_dir": root / "run", "prefect_port": port, "deployments": root / "prefect.yaml"}
    )
    config.state_dir.mkdir(parents=True)
    assert register_deployments(config).startswith(f"registered {len(spec['deployments'])} deployments")
    return prefect_server.removesuffix("/api")


def login(driver: webdriver.Chrome, root: str, auth: str) -> None:
    """Give the dashboard's login prompt `auth` (the page asks it before anything else)."""
    driver.get(root + "/dashboard")
    field = WebDriverWait(driver, 60).until(
        ec.visibility_of_element_located((By.CSS_SELECTOR, "input[type='password']"))
    )
    field.clear()
    field.send_keys(auth)
    driver.find_element(By.CSS_SELECTOR, "button[type='submit']").click()


@pytest.fixture(scope="module")
def logged_in(browser: webdriver.Chrome, registered: str) -> str:
    """The dashboard's root URL, the browser logged in with the server's auth string (the session's clients'); a
    wrong string first, which the prompt refuses."""
    login(browser, registered, "mint:not-the-password")
    wait_text(browser, ["Authentication failed"], timeout=30)
    assert browser.find_elements(By.CSS_SELECTOR, "input[type='password']"), (
        "a wrong string got past the login"
    )
    login(browser, registered, os.environ["PREFECT_API_AUTH_STRING"])
    WebDriverWait(browser, 60).until(
        lambda d: not d.find_elements(By.CSS_SELECTOR, "input[type='password']"), "the login prompt stayed"
    )
    return registered


def wait_text(driver: webdriver.Chrome, texts: list[str], timeout: float = 60) -> str:
    """The page's text once every one of `texts` is in it (the dashboard renders after its API calls)."""

    def has_all(d: webdriver.Chrome) -> str | bool:
        body = d.find_element(By.TAG_NAME, "body").text
        return body if all(t in body for t in texts) else False

    try:
        return str(WebDriverWait(driver, timeout, poll_frequency=0.5).until(has_all))
    except TimeoutException:
        body = driver.find_element(By.TAG_NAME, "body").text
        missing = [t for t in texts if t not in body]
        raise AssertionError(f"{missing} not on {driver.current_url}:\n{body[:3000]}") from None


def test_the_deployments_page_lists_every_mint_deployment(browser: webdriver.Chrome, logged_in: str) -> None:
    browser.get(logged_in + "/deployments")
    body = wait_text(browser, list(FLOWS))
    assert "mint-ui-" in body or "mint" in body


def test_quick_run_from_the_dashboard_creates_a_flow_run(browser: webdriver.Chrome, logged_in: str) -> None:
    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name("prefetch/prefetch")
    browser.get(f"{logged_in}/deployments/deployment/{dep.id}")
    wait_text(browser, ["prefetch"])
    WebDriverWait(browser, 30).until(
        ec.element_to_be_clickable((By.XPATH, "//button[normalize-space()='Run']"))
    ).click()
    # the Run menu: Quick run (the deployment's defaults) or Custom run (the form)
    WebDriverWait(browser, 30).until(
        ec.element_to_be_clickable(
            (By.XPATH, "//*[@role='menuitem' or self::button][normalize-space()='Quick run']")
        )
    ).click()
    deadline = time.monotonic() + 30
    runs: list[FlowRun] = []
    submitted = False
    while not runs:
        # a flow with a required parameter (prefetch's `policies`) opens its form, filled with the deployment's
        # values: submit it as it is
        submit = browser.find_elements(By.XPATH, "//*[@role='dialog']//button[normalize-space()='Run']")
        if submit and not submitted:
            submit[-1].click()
            submitted = True
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id]))
            )
        body = browser.find_element(By.TAG_NAME, "body").text
        assert runs or time.monotonic() < deadline, f"Quick run created no flow run:\n{body[:3000]}"
        time.sleep(0.5)
    assert runs[0].parameters["policies"] == ["add", "reverse", "sort"]  # the deployment's defaults
    with get_client(sync_client=True) as client:  # nobody polls this pool: leave nothing scheduled
        for r in runs:
            client.delete_flow_run(r.id)
