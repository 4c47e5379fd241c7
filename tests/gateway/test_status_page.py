"""The status page end to end: a real stack (supervisord, engine, gateway on
the demo model) and the page in a real headless Chromium (Debian's, through
selenium: mlxd.devkit.browser). The page's files are open and hold no data;
its data, /mlxd/status, needs the key; the page asks for the key, shows the
stack, follows a request while it runs, shows a crash on the journal's
timeline, and brings the form back on a wrong key. No test leaves the key in
a URL or the page's source, and none sees a console error it did not cause."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import requests

from mlxd.devkit.browser import headless_chromium, missing
from testkit import REQUIRE_REAL_MODEL, wait_until

pytestmark = pytest.mark.timeout(180)
EVERY_S = 0.5  # the page's refresh and the gateway's sampling: quick, for the test
PROMPT = "tell me about the slow machine " * 12  # ~85 tokens: ~3.4 s of prefill at 40 ms a token
FAULT = "slow@prefill:40"


def require_browser() -> None:
    """Skip without Chromium, saying how to get it; with $MLXD_REQUIRE_REAL_MODEL (CI, which
    installs it) fail instead, as testkit.real_default_model does."""
    why = missing()
    if why is None:
        return
    if os.environ.get(REQUIRE_REAL_MODEL):
        pytest.fail(f"{REQUIRE_REAL_MODEL} is set but {why}")
    pytest.skip(why)


@pytest.fixture(scope="module")
def st(module_stack):
    return module_stack(gateway=f"status_sample_s = {EVERY_S}\n")


@pytest.fixture(scope="module")
def browser():
    require_browser()
    with headless_chromium() as b:  # quit, and its processes killed by pid, at the end
        yield b


@pytest.fixture
def page(browser, st):
    """The page as a test leaves it: no console error the test did not expect, no key in any URL it
    requested or in its source."""
    browser.console_errors(), browser.requests()  # drain what came before
    yield browser
    assert browser.console_errors() == []
    assert_key_only_in_headers(browser, st.key)


def assert_key_only_in_headers(browser, key: str) -> None:
    """No URL the page requested and not its source holds `key`: it went where it belongs, in the
    Authorization header of the page's data requests."""
    sent = browser.requests()
    assert not [r["url"] for r in sent if key in r["url"]]
    assert key not in browser.driver.page_source
    data = [r for r in sent if r["url"].endswith("/mlxd/status")]
    assert data and all(r["headers"].get("Authorization") == f"Bearer {key}" for r in data)


def wait_page(browser, condition, timeout: float = 30, what: str = "the page"):
    return wait_until(lambda: condition(browser.driver), timeout, interval=0.1, what=what)


# The page redraws its parts on every refresh: each read is one script, never an element kept between calls.
def read(driver, css: str, attribute: str | None = None) -> list[str]:
    """The text (or `attribute`) of every element `css` selects."""
    return driver.execute_script("return [...document.querySelectorAll(arguments[0])]"
                                 ".map(e => arguments[1] ? (e.getAttribute(arguments[1]) || '') : e.textContent)",
                                 css, attribute)


def text(driver, css: str) -> str:
    return " ".join(read(driver, css))


def shown(driver, css: str) -> bool:
    return driver.execute_script("const e = document.querySelector(arguments[0]); return !!e && e.checkVisibility()",
                                 css)


def number(driver, css: str, attribute: str) -> float:
    got = read(driver, css, attribute)
    return float(got[0]) if got and got[0] else 0.0


def open_page(browser, st, key: str | None) -> None:
    """The page afresh, no key remembered; with `key`, entered in its form."""
    driver = browser.driver
    old = driver.current_window_handle
    driver.switch_to.new_window("tab")  # a tab of its own: an empty sessionStorage
    new = driver.current_window_handle
    driver.switch_to.window(old)
    driver.close()
    driver.switch_to.window(new)
    driver.execute_cdp_cmd("Storage.clearDataForOrigin", {"origin": st.gateway_url, "storageTypes": "local_storage"})
    driver.get(f"{st.gateway_url}/ui?every={EVERY_S}")
    wait_page(browser, lambda d: shown(d, "#key-input"), what="the key form")
    if key is not None:
        driver.find_element("id", "key-input").send_keys(key)
        driver.find_element("id", "key-submit").click()


def refreshed(browser) -> int:
    return int(number(browser.driver, "body", "data-refreshes"))


# --- the routes, without a browser --------------------------------------------------------------------------

def test_the_pages_files_are_open_and_its_data_needs_the_key(st):
    for path, kind in (("/ui", "text/html"), ("/ui/", "text/html"), ("/ui/app.js", "text/javascript"),
                       ("/ui/style.css", "text/css")):
        r = requests.get(st.gateway_url + path, timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), path
        assert "script-src 'self'" in r.headers["content-security-policy"] and st.key not in r.text
    assert requests.post(st.gateway_url + "/ui", timeout=10).status_code == 405
    assert requests.get(st.gateway_url + "/ui/secrets.json", timeout=10).status_code == 401  # only the page's files
    url = st.gateway_url + "/mlxd/status"
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        r = requests.get(url, headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
    r = requests.get(url, headers={"Authorization": f"Bearer {st.key}"}, timeout=30)
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    doc = r.json()
    assert set(doc) == {"time", "status", "journal", "models", "history"} and st.key not in r.text
    assert doc["status"]["overall"] == "healthy" and doc["status"]["engine"]["health"]["resident_model"] == "demo-a"
    chat = [m for m in doc["models"]["models"] if m["kind"] == "chat"]
    assert [m["id"] for m in chat] == ["demo-a"] and chat[0]["state"] == "loaded"
    assert doc["history"]["interval_s"] == EVERY_S


# --- the page in Chromium ---------------------------------------------------------------------------------------

def test_the_page_asks_for_the_key_then_shows_the_stack(page, st):
    open_page(page, st, key=None)
    assert not shown(page.driver, "#dashboard")  # nothing without the key: not even a request for the data
    assert not [r for r in page.requests() if r["url"].endswith("/mlxd/status")]
    page.driver.find_element("id", "key-input").send_keys(st.key)
    page.driver.find_element("id", "key-submit").click()
    wait_page(page, lambda d: shown(d, "#dashboard") and "demo-a" in text(d, "#resident-model"), what="the model")
    assert text(page.driver, "#overall") == "healthy" and not shown(page.driver, "#login")
    assert "running" in text(page.driver, "#state-supervisord")
    row = text(page.driver, "#models tr[data-id='demo-a']")
    assert "loaded" in row and "default" in row and "yes" in row
    assert page.driver.execute_script("return sessionStorage.length") == 1  # the tab's, not remembered
    first = refreshed(page)
    wait_page(page, lambda d: refreshed(page) >= first + 2, what="the page to refresh on its own")


def test_a_running_request_shows_and_the_history_moves(page, st):
    open_page(page, st, key=st.key)
    wait_page(page, lambda d: "demo-a" in text(d, "#resident-model"), what="the model")
    st.fault_file.write_text(FAULT)  # a prefill of seconds: long enough to be seen running
    answer: dict = {}

    def stream() -> None:
        body = {"model": "default", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 48,
                "temperature": 0, "stream": True}
        with requests.post(st.gateway_url + "/v1/chat/completions", json=body, stream=True, timeout=120,
                           headers={"Authorization": f"Bearer {st.key}"}) as r:
            answer["status"], answer["body"] = r.status_code, r.text

    client = threading.Thread(target=stream)
    client.start()
    try:
        running = "#requests tbody tr.prefilling, #requests tbody tr.decoding"
        wait_page(page, lambda d: read(d, running) and number(d, "#request-counts", "data-running") == 1,
                  what="the request shown running")
        wait_page(page, lambda d: number(d, "#legend-requests [data-field=running]", "data-peak") >= 1,
                  what="the request in the history")
    finally:
        client.join(120)
        st.fault_file.unlink(missing_ok=True)
    assert answer["status"] == 200 and "[DONE]" in answer["body"]
    wait_page(page, lambda d: number(d, "#legend-tokens [data-field=tok_s]", "data-peak") > 0,
              what="tok/s in the history")
    wait_page(page, lambda d: not read(d, "#requests tbody tr") and number(d, "#request-counts", "data-running") == 0,
              what="the request gone once answered")
    assert read(page.driver, "#reuse tbody tr"), "the prompt cache's reuse of the conversation"


def test_an_engine_crash_shows_on_the_timeline(page, st):
    open_page(page, st, key=st.key)
    wait_page(page, lambda d: "demo-a" in text(d, "#resident-model"), what="the model")
    assert not read(page.driver, "#timeline circle.crash")
    os.kill(st.engine_pid(), signal.SIGKILL)
    wait_page(page, lambda d: "sigkill" in text(d, "#journal"), timeout=60,
              what="the crash in the journal")
    assert read(page.driver, "#timeline circle.crash")
    assert "1 last hour" in text(page.driver, "#state-crashes")
    wait_until(st.healthy, 60, what="the engine back")
    wait_page(page, lambda d: text(d, "#overall") == "healthy", timeout=60, what="healthy again")


def test_a_wrong_key_brings_the_form_back_with_the_401s_message(browser, st):
    browser.console_errors(), browser.requests()
    open_page(browser, st, key="sk-mlxd-wrong")
    wait_page(browser, lambda d: shown(d, "#key-error") and "invalid API key" in text(d, "#key-error"),
              what="the 401's message")
    assert shown(browser.driver, "#key-input") and not shown(browser.driver, "#dashboard")
    assert browser.driver.execute_script("return sessionStorage.length + localStorage.length") == 0  # forgotten
    # The one console error: Chromium's own line for the 401 the page was answered.
    errors = browser.console_errors()
    assert errors and all("/mlxd/status" in e and "401" in e for e in errors), errors
    assert_key_only_in_headers(browser, "sk-mlxd-wrong")
    assert st.key not in browser.driver.page_source
