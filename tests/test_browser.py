"""The playground and the dashboard in a real headless Chromium, against a real gateway + worker.

The gateway runs with an API key, so the pages' key field and Bearer header are exercised too.

The browser tests skip cleanly when selenium, chromium or chromedriver are missing
(Debian: `apt-get install chromium chromium-driver`; `pip install selenium`). Screenshots
go to the test's temporary directory and, when $SPECULANT_SCREENSHOT_DIR is set, there too.
"""

from __future__ import annotations

import json

import os
import pathlib
import shutil
import time

import pytest
from servers import gateway_and_worker, http

from gateway.pages import TokenRate, aggregate

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
# No internet here: without the background-networking flags chromium keeps dialling out.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1280,900"]
# A copy-heavy request: the n-gram proposer finds the answer in the prompt, so drafts are accepted.
COPY_PROMPT = ("Fix the typo and return the whole sentence: The cat sat on the mat and looked out of the "
               "windoow at the birds in the garden.")
WAIT = 60  # s, generous: two CPU cores shared with other work
API_KEY = "sk-browser-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:
    webdriver = None

has_browser = webdriver is not None and os.path.isfile(CHROMIUM) and os.path.isfile(CHROMEDRIVER)
needs_browser = pytest.mark.skipif(not has_browser, reason="needs selenium, chromium and chromedriver")


# ---------------------------------------------------------------- stats aggregation (no server)


def _worker(**stats) -> dict:
    names = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "num_preemptions", "num_drafts",
             "num_draft_tokens", "num_accepted_tokens", "prefix_cache_hits", "prefix_cache_queries")
    base = {**dict.fromkeys(names, 0), "kv_usage": 0.0, "accepted_per_pos": []}
    return {**base, **stats}


def test_aggregate_sums_workers_and_follows_vllm_rates():
    a = _worker(num_running=2, num_free_blocks=6, num_total_blocks=10, num_drafts=4, num_draft_tokens=12,
                num_accepted_tokens=6, accepted_per_pos=[4, 2, 0])
    b = _worker(num_waiting=1, num_free_blocks=10, num_total_blocks=10, num_drafts=6, num_draft_tokens=6,
                num_accepted_tokens=3, accepted_per_pos=[3], prefix_cache_hits=1, prefix_cache_queries=4)
    t = aggregate([a, b])
    assert (t["num_workers"], t["num_running"], t["num_waiting"]) == (2, 2, 1)
    assert t["kv_usage"] == pytest.approx(4 / 20)  # used blocks over all blocks
    assert t["accepted_per_pos"] == [7, 2, 0]  # shorter lists pad with zeros
    assert t["acceptance_rate"] == pytest.approx(9 / 18)
    assert t["mean_acceptance_length"] == pytest.approx(1 + 9 / 10)
    assert t["acceptance_per_pos"] == pytest.approx([0.7, 0.2, 0.0])
    assert t["prefix_cache_hit_rate"] == pytest.approx(0.25)


def test_aggregate_of_nothing_has_no_rates():
    t = aggregate([_worker()])
    assert t["acceptance_rate"] is None and t["mean_acceptance_length"] is None
    assert t["acceptance_per_pos"] == [] and t["kv_usage"] == 0.0
    assert aggregate([])["num_workers"] == 0


def test_token_rate_uses_a_sliding_window():
    rate = TokenRate(window=5.0)
    assert rate.update(100.0, 0) == 0.0
    assert rate.update(101.0, 50) == pytest.approx(50.0)
    assert rate.update(102.0, 150) == pytest.approx(75.0)
    assert rate.update(110.0, 150) == pytest.approx(0.0, abs=1e-9)  # old samples left the window
    assert rate.update(111.0, 250) == pytest.approx(100.0)


# ---------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_path):
    env = {"SPECULANT_API_KEY": API_KEY}
    with gateway_and_worker(tmp_path_factory.mktemp("browser_servers"), model_path, env) as c:
        yield c


def test_stats_endpoint_reports_workers_and_tokens(cluster):
    assert http(f"{cluster.url}/v1/speculant/stats")[0] == 401  # behind the API key, like /v1
    status, before, headers = http(f"{cluster.url}/v1/speculant/stats", headers=AUTH)
    assert status == 200 and headers["Cache-Control"] == "no-store"
    assert before["totals"]["num_workers"] == 1 and before["workers"][0]["worker_id"] == "w1"
    body = {"prompt": "Hello", "max_tokens": 5, "temperature": 0}
    status, reply, _ = http(f"{cluster.url}/v1/completions", body, headers=AUTH)
    assert status == 200
    _, after, _ = http(f"{cluster.url}/v1/speculant/stats", headers=AUTH)
    made = reply["usage"]["completion_tokens"]
    assert after["gateway"]["generation_tokens"] - before["gateway"]["generation_tokens"] == made
    assert after["gateway"]["num_requests_finished"] - before["gateway"]["num_requests_finished"] == 1
    assert after["gateway"]["tokens_per_s"] >= 0
    for path in ("/", "/playground", "/dashboard", "/static/playground.js", "/static/style.css"):
        assert http(cluster.url + path)[0] == 200, path  # the page shells need no key


# ---------------------------------------------------------------- browser


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not has_browser:
        pytest.skip("needs selenium, chromium and chromedriver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS + [f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"]:
        options.add_argument(flag)
    service = Service(executable_path=CHROMEDRIVER)  # an explicit path: selenium-manager never runs
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_page_load_timeout(WAIT)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    """Saves a screenshot into the test's directory (and $SPECULANT_SCREENSHOT_DIR if set)."""
    out = tmp_path_factory.mktemp("screenshots")
    extra = os.environ.get("SPECULANT_SCREENSHOT_DIR")

    def save(driver, name: str) -> pathlib.Path:
        path = out / f"{name}.png"
        assert driver.save_screenshot(str(path))
        if extra:
            pathlib.Path(extra).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, pathlib.Path(extra) / path.name)
        return path

    return save


def wait_for(driver, condition, message: str):
    return WebDriverWait(driver, WAIT, poll_frequency=0.2).until(lambda d: condition(d), message)


def browser_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


@needs_browser
def test_playground_streams_coloured_tokens(browser, cluster, shots):
    browser.get(cluster.url + "/")
    assert browser.title == "Speculant playground"
    key = wait_for(browser, lambda d: d.find_element(By.ID, "api-key") if d.find_element(By.ID, "api-key")
                   .is_displayed() else None, "no key field after the gateway said 401")
    key.send_keys(API_KEY, Keys.TAB)  # `change` stores it and reloads the model list
    wait_for(browser, lambda d: "SmolLM2" in d.find_element(By.ID, "model-name").text, "model name not shown")
    browser_errors(browser)  # drop the expected 401 from the console log
    max_tokens = browser.find_element(By.ID, "max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("48")
    browser.find_element(By.ID, "prompt").send_keys(COPY_PROMPT)
    browser.find_element(By.ID, "send").click()
    stats = wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".answer-stats[data-done='1']"),
                     "the answer did not finish")[0]
    assert browser.find_element(By.ID, "error").get_attribute("class") == "error hidden"
    drafted = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .tok.draft")
    target = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .tok.target")
    assert drafted and target  # both provenance colours on screen
    assert int(stats.get_attribute("data-accepted")) > 0 and "accepted" in stats.text
    # The spans spell the answer, and it is the same text a plain (non-provenance) client gets.
    answer = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .body").get_attribute("textContent")
    status, plain, _ = http(f"{cluster.url}/v1/chat/completions",
                            {"messages": [{"role": "user", "content": COPY_PROMPT}], "max_tokens": 48,
                             "temperature": 0}, headers=AUTH)
    assert status == 200 and "speculant" not in plain  # the extension is opt-in
    assert answer == plain["choices"][0]["message"]["content"]
    colours = {browser.execute_script("return getComputedStyle(arguments[0]).backgroundColor", el)
               for el in (drafted[0], target[0])}
    assert len(colours) == 2  # the two kinds really look different
    shots(browser, "playground")
    assert browser_errors(browser) == []


@needs_browser
def test_playground_speculation_switch_sends_n_max_0(browser, cluster):
    browser.get(cluster.url + "/playground")
    browser.execute_script("localStorage.setItem('speculant-api-key', arguments[0])", API_KEY)
    browser.refresh()
    wait_for(browser, lambda d: "SmolLM2" in d.find_element(By.ID, "model-name").text, "model name not shown")
    browser.find_element(By.ID, "spec-on").click()  # off: the request carries speculative.n_max = 0
    browser.find_element(By.ID, "prompt").send_keys(COPY_PROMPT, Keys.ENTER)
    stats = wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".answer-stats[data-done='1']"),
                     "the answer did not finish")[0]
    assert stats.get_attribute("data-drafted") == "0" and stats.get_attribute("data-accepted") == "0"
    assert browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .tok.target")
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .tok.draft")
    assert browser_errors(browser) == []


@needs_browser
def test_playground_method_choice_lists_proposers_and_streams_with_the_chosen_one(browser, cluster):
    from selenium.webdriver.support.ui import Select

    browser.get(cluster.url + "/playground")
    browser.execute_script("localStorage.setItem('speculant-api-key', arguments[0])", API_KEY)
    browser.refresh()
    options = wait_for(browser, lambda d: [o.get_attribute("value") for o in d.find_elements(By.CSS_SELECTOR, "#method option")]
                       if len(d.find_elements(By.CSS_SELECTOR, "#method option")) > 1 else None, "no methods listed")
    assert {"ngram", "suffix", "eagle"} <= set(options)
    Select(browser.find_element(By.ID, "method")).select_by_value("suffix")
    browser.find_element(By.ID, "prompt").send_keys(COPY_PROMPT, Keys.ENTER)
    stats = wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".answer-stats[data-done='1']"),
                     "the answer did not finish")[0]
    assert int(stats.get_attribute("data-drafted")) > 0  # the suffix proposer drafted for this request
    assert browser.find_element(By.ID, "error").get_attribute("class") == "error hidden"
    assert browser_errors(browser) == []


@needs_browser
def test_playground_json_schema_colours_grammar_forced_tokens(browser, cluster, shots):
    """A schema typed into the playground constrains the answer; tokens the grammar forced get their own colour."""
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "favourite_food"],
              "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0},
                             "favourite_food": {"type": "string", "maxLength": 16}}}
    browser.get(cluster.url + "/playground")
    browser.execute_script("localStorage.setItem('speculant-api-key', arguments[0])", API_KEY)
    browser.refresh()
    wait_for(browser, lambda d: "SmolLM2" in d.find_element(By.ID, "model-name").text, "model name not shown")
    browser.execute_script("document.getElementById('json-schema').value = arguments[0]", json.dumps(schema))
    browser.find_element(By.ID, "prompt").send_keys("Describe a cat called Tom as JSON.", Keys.ENTER)
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".answer-stats[data-done='1']"), "the answer did not finish")
    assert browser.find_element(By.ID, "error").get_attribute("class") == "error hidden"
    answer = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .body").get_attribute("textContent")
    assert set(json.loads(answer)) == {"name", "age", "favourite_food"}
    forced = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .tok.grammar")
    assert forced  # e.g. the keys after the first one
    colours = {browser.execute_script("return getComputedStyle(arguments[0]).backgroundColor", el)
               for el in forced[:1] + browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .tok.target")[:1]}
    assert len(colours) == 2
    shots(browser, "playground-schema")
    assert browser_errors(browser) == []


@needs_browser
def test_dashboard_numbers_change_after_requests(browser, cluster, shots):
    browser.get(cluster.url + "/dashboard")
    browser.execute_script("localStorage.setItem('speculant-api-key', arguments[0])", API_KEY)
    wait_for(browser, lambda d: d.find_element(By.ID, "num-workers").text == "1", "dashboard shows no worker")
    generated = browser.find_element(By.ID, "generation-tokens")
    before = int(generated.text)
    body = {"messages": [{"role": "user", "content": COPY_PROMPT}], "max_tokens": 32, "temperature": 0}
    status, reply, _ = http(f"{cluster.url}/v1/chat/completions", body, headers=AUTH)
    assert status == 200 and reply["usage"]["speculative"]["num_accepted_tokens"] > 0
    made = reply["usage"]["completion_tokens"]
    wait_for(browser, lambda d: int(generated.text) >= before + made, "generated tokens did not grow")
    assert int(generated.text) == before + made
    wait_for(browser, lambda d: d.find_element(By.ID, "acceptance-rate").text.endswith("%"),
             "no acceptance rate")  # the worker's next heartbeat carries the drafts
    bars = browser.find_elements(By.CSS_SELECTOR, "#per-pos .bar")
    assert len(bars) == 3  # one per draft position (k = 3)
    assert browser.find_element(By.CSS_SELECTOR, "#workers td").text == "w1"
    time.sleep(1.2)  # one more poll, so the tokens/s chart has a few bars
    shots(browser, "dashboard")
    assert browser_errors(browser) == []
