"""The chat page of `specquant serve` (GET /), in a real browser: Debian's headless Chromium driven by Selenium.

The page and its headers are checked over HTTP first (no browser, no model). The browser tests start real
servers on the demo family: `page_server` (API key, policies auto/parent/spec-q4) for the answers, the key,
Stop and the rendering; `fault_server` (parent by default, no queue) for the busy and dead-server messages.
Without Chromium and its driver the browser tests fail (scripts/test.sh installs them: apt-get install chromium
chromium-driver); Selenium Manager's own download is never used."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait
from test_serve import COUNTING, KEY, LONG, N, ServerProc, chat_cli, wait_for

from specquant_cli.serving.app import CSP, PAGE_FILES, STATIC_DIR, _add_page
from specquant_cli.serving.guard import Guard

from conftest import REPO

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
PROMPT = "What is the capital of France?"
FOLLOW_UP = "And of Italy?"
COUNT_PROMPT = "Count from 1 to 500, separated by commas."
ANSWER_TIMEOUT_S = 120
SCREENSHOT = REPO / "bench-results" / "chat-page.png"  # the test artifact (bench-results/ is not committed)


# -- the page over HTTP (no browser, no model) ---------------------------------------------------------

def _page_client(key: str | None = "k"):
    """The page's routes and a stand-in /v1 and /health, inside the real guard."""
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from specquant_cli.serving.app import PUBLIC_PATHS

    app = FastAPI()
    _add_page(app)
    app.get("/health")(lambda: {"status": "ok"})
    app.get("/v1/models")(lambda: {"object": "list", "data": []})
    return TestClient(Guard(app, key, log=lambda line: None, public=PUBLIC_PATHS), base_url="http://localhost")


def test_the_page_needs_no_key_but_every_api_call_does():
    client = _page_client()
    for path in PAGE_FILES:
        r = client.get(path)
        assert r.status_code == 200, path
        assert r.headers["content-security-policy"] == CSP and r.headers["x-content-type-options"] == "nosniff"
    assert client.get("/health").status_code == 200
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    assert client.post("/", json={}).status_code == 401  # only GET and HEAD of the page are open
    assert client.get("/static/nothing.js").status_code == 401
    assert client.get("/").headers["content-type"].startswith("text/html")
    assert client.get("/static/page.js").headers["content-type"].startswith("text/javascript")


def test_the_csp_allows_this_origin_only():
    directives = dict(d.strip().split(" ", 1) for d in CSP.split(";"))
    assert directives["default-src"] == "'none'"
    for name in ("script-src", "style-src", "connect-src", "img-src"):
        assert directives[name] == "'self'", name
    assert directives["frame-ancestors"] == "'none'"


def test_the_page_loads_nothing_from_outside_and_writes_no_html():
    html = (STATIC_DIR / "index.html").read_text()
    refs = re.findall(r'(?:src|href)="([^"]*)"', html)
    assert refs and all(r.startswith("/") and not r.startswith("//") for r in refs), refs
    assert "<style" not in html and " style=" not in html and "<script>" not in html  # nothing inline (CSP)
    js = (STATIC_DIR / "page.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in js, sink
    assert not re.search(r"https?://", js + (STATIC_DIR / "page.css").read_text())
    assert set(re.findall(r'fetch\("([^"]+)"', js)) == {"/v1/models", "/v1/chat/completions"}


# -- the browser -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.fail(f"the browser tests need {' and '.join(missing)}: apt-get install -y chromium chromium-driver "
                    "(scripts/test.sh installs them)", pytrace=False)
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900", "--lang=en-US"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=opts)
    except WebDriverException as e:
        pytest.fail(f"headless Chromium did not start: {e.msg}", pytrace=False)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def page_server(family_dir):
    s = ServerProc(["--family", str(family_dir), "--api-key", KEY, "--policies", "auto,parent,spec-q4"])
    yield s
    s.stop()


class Page:
    """The chat page in the browser, by the ids and data attributes page.js keeps."""

    def __init__(self, driver, url: str):
        self.d = driver
        self.url = url

    def open(self, key: str | None = None, keep_session: bool = False) -> Page:
        self.d.get(self.url + "/")
        if not keep_session:
            self.d.execute_script("sessionStorage.clear()")
            self.d.get(self.url + "/")
        if key is not None:
            self.wait(lambda d: self.shown("key-form"))
            self.enter_key(key)
        return self

    def el(self, id_: str):
        return self.d.find_element(By.ID, id_)

    def shown(self, id_: str) -> bool:
        return self.el(id_).get_attribute("hidden") is None

    def wait(self, cond, timeout: float = 30):
        return WebDriverWait(self.d, timeout, poll_frequency=0.1).until(cond)

    def enter_key(self, key: str) -> None:
        self.el("key-input").send_keys(key)
        self.el("key-save").click()

    def policies(self) -> tuple[list[str], str]:
        select = Select(self.el("policy"))
        return [o.get_attribute("value") for o in select.options], select.first_selected_option.get_attribute("value")

    def set(self, id_: str, value) -> None:
        el = self.el(id_)
        el.clear()
        el.send_keys(str(value))

    def send(self, prompt: str, policy: str, max_tokens: int = N, temperature: float = 0) -> None:
        self.wait(lambda d: policy in self.policies()[0])
        Select(self.el("policy")).select_by_value(policy)
        self.set("max-tokens", max_tokens)
        self.set("temperature", temperature)
        self.set("prompt", prompt)
        self.el("send").click()

    def turns(self, role: str = "assistant") -> list:
        return self.d.find_elements(By.CSS_SELECTOR, f".turn.{role}")

    def last_state(self) -> str | None:
        turns = self.turns()
        return turns[-1].get_attribute("data-state") if turns else None

    def ask(self, prompt: str, policy: str, **kw) -> str:
        """Send `prompt` and wait for the answer to finish; its displayed text."""
        before = len(self.turns())
        self.send(prompt, policy, **kw)
        self.wait(lambda d: len(self.turns()) > before and self.last_state() != "streaming", ANSWER_TIMEOUT_S)
        assert self.last_state() == "done", self.error()
        return self.answer()

    def answer(self) -> str:
        return self.d.execute_script("return document.querySelector('.turn.assistant:last-of-type .text').textContent")

    def spans(self) -> list[tuple[str, str]]:
        return [tuple(s) for s in self.d.execute_script(
            "return [...document.querySelectorAll('.turn.assistant:last-of-type .text .tok')]"
            ".map(s => [s.textContent, s.dataset.source])")]

    def error(self) -> str:
        return self.el("error").text if self.shown("error") else ""

    def idle(self) -> bool:
        """No spinner, Send usable, Stop not."""
        return not self.shown("busy") and self.el("send").is_enabled() and not self.el("stop").is_enabled()

    def csp_violations(self) -> list[str]:
        return [e["message"] for e in self.d.get_log("browser") if "Content Security Policy" in e["message"]]


@pytest.fixture
def page(browser, page_server) -> Page:
    return Page(browser, page_server.url)


def _ask_api(server: ServerProc, messages: list[dict]) -> str:
    r = server.client().chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=N,
                                                temperature=0, extra_body={"specquant_policy": "parent"})
    return r.choices[0].message.content


# -- answers ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_parent_answer_equals_the_cli_and_the_conversation_goes_on(page, page_server, family_dir, monkeypatch):
    expected = chat_cli(family_dir, PROMPT, monkeypatch)
    page.open(key=KEY)
    page.wait(lambda d: page.el("model-name").text == "smollm2-135m")
    assert page.policies() == (["auto", "parent", "spec-q4"], "auto")
    assert page.ask(PROMPT, "parent") == expected
    assert {source for _, source in page.spans()} == {"parent"}
    assert "parent alone" in page.el("stat-plan").text
    assert page.el("stat-tier").text.split()[0] in ("low", "medium", "high")
    assert re.fullmatch(r"[\d.]+|not calibrated", page.el("stat-parent").text)
    # The second turn is asked with the first in its context (the server applies the chat template).
    history = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": expected}]
    assert page.ask(FOLLOW_UP, "parent") == _ask_api(page_server, [*history, {"role": "user", "content": FOLLOW_UP}])
    assert len(page.turns()) == 2 and len(page.turns("user")) == 2
    assert not page.csp_violations()


@pytest.mark.slow
def test_spec_q4_answer_shows_accepted_drafts_that_add_up_to_the_parent_answer(page, family_dir, monkeypatch):
    expected = chat_cli(family_dir, PROMPT, monkeypatch)
    page.open(key=KEY)
    assert page.ask(PROMPT, "spec-q4") == expected
    spans = page.spans()
    assert "".join(text for text, _ in spans) == expected
    assert any(source == "draft" and text for text, source in spans), spans
    assert {source for _, source in spans} <= {"draft", "parent"}
    assert page.el("stat-plan").text == "spec-q4: q4 drafts, parent verifies"
    assert re.fullmatch(r"\d+ %", page.el("stat-acceptance").text)
    assert re.fullmatch(r"[\d.]+", page.el("stat-tps").text) and page.el("stat-tokens").text.isdigit()
    SCREENSHOT.parent.mkdir(exist_ok=True)
    assert page.d.save_screenshot(str(SCREENSHOT))
    assert not page.csp_violations()


@pytest.mark.slow
def test_stop_ends_the_stream_and_the_server_answers_the_next_request(page, page_server):
    page.open(key=KEY)
    page.send(COUNT_PROMPT, "parent", max_tokens=2000)
    page.wait(lambda d: len(page.spans()) >= 3, ANSWER_TIMEOUT_S)
    t0 = time.monotonic()
    page.el("stop").click()
    # Client-side once the click lands; bounded generously: on 2 busy cores a browser's event loop can lag (seen
    # once in a full suite past 10 s, never alone).
    page.wait(lambda d: page.last_state() == "stopped", 30)
    assert page.idle() and "stopped" in page.turns()[-1].text and not page.error()
    shown = page.answer()
    assert wait_for(lambda: not page_server.health()["busy"], timeout=10)  # the server stopped generating
    assert page.answer() == shown  # nothing arrived after Stop
    assert page.ask(PROMPT, "parent")  # the next request is answered
    assert time.monotonic() - t0 < 60
    assert wait_for(lambda: "(client disconnected)" in page_server.log(), timeout=5)


@pytest.mark.slow
def test_a_wrong_key_shows_the_401_message_and_the_right_one_recovers(page):
    page.open(key="wrong-key")
    page.wait(lambda d: "401" in page.error())
    assert "refused the API key" in page.error() and page.shown("key-form") and page.idle()
    page.d.execute_script("document.getElementById('error').hidden = true")  # the next message is the chat's
    page.send(PROMPT, "")  # the policies are not loaded: the selector offers the server's default (sends none)
    page.wait(lambda d: not page.turns() and page.idle() and "401" in page.error())
    assert page.el("prompt").get_property("value") == PROMPT  # given back for a retry
    page.enter_key(KEY)
    page.wait(lambda d: not page.error() and page.el("model-name").text == "smollm2-135m")
    assert "auto" in page.policies()[0] and not page.shown("key-form")
    assert page.d.execute_script("return sessionStorage.getItem('specquant-api-key')") == KEY


@pytest.mark.slow
def test_model_output_is_shown_as_text_never_as_html(page):
    page.open(key=KEY)
    hostile = '<img src=x onerror="window.__xss = 1">'
    got = page.d.execute_script("""
        window.__xss = 0;
        const box = document.createElement('div');
        document.body.append(box);
        specquantPage.appendSpans(box, [{text: arguments[0], source: 'draft'},
                                        {text: '<script>window.__xss = 2</script>', source: 'parent'},
                                        {text: '<b>x</b>', source: 'nonsense'}]);
        return [box.textContent, box.querySelectorAll('img, script, b').length,
                [...box.children].map(c => c.className)];
    """, hostile)
    assert got == [hostile + "<script>window.__xss = 2</script><b>x</b>", 0,
                   ["tok src-draft", "tok src-parent", "tok src-unknown"]]
    time.sleep(0.5)  # an image error handler would have run by now
    assert page.d.execute_script("return window.__xss") == 0
    # spans that do not add up to the chunk's text are not trusted: the text is shown whole, unattributed
    assert page.d.execute_script("return specquantPage.chunkSpans('ab', [{text: 'a', source: 'draft'}])") == \
        [{"text": "ab", "source": "unknown"}]


# -- errors: a busy server, a dead one -------------------------------------------------------------

@pytest.fixture(scope="module")
def fault_server(family_dir):
    s = ServerProc(["--family", str(family_dir), "--policy", "parent", "--policies", "auto,parent", "--queue", "0",
                    "--parallel", "1"])
    yield s
    s.stop(signal.SIGKILL)


@pytest.mark.slow
def test_busy_and_dead_server_show_readable_messages_not_a_spinner(browser, fault_server):
    page = Page(browser, fault_server.url).open()
    page.wait(lambda d: page.el("model-name").text == "smollm2-135m")
    assert not page.shown("key-form")  # no key on this server: the page never asks
    assert page.policies() == (["auto", "parent"], "parent")  # the server's default is selected, not auto
    client = fault_server.client(key="unused")
    stream = client.completions.create(model="m", prompt=COUNTING, max_tokens=LONG, temperature=0, stream=True)
    try:
        next(iter(stream))  # generating: the engine is busy and the queue (0) is full
        page.send(PROMPT, "parent")
        page.wait(lambda d: "429" in page.error() and page.idle())
        assert "busy" in page.error() and "Try again in about" in page.error() and not page.turns()
    finally:
        stream.close()
    assert wait_for(lambda: not fault_server.health()["busy"], timeout=10)
    page.send(COUNT_PROMPT, "parent", max_tokens=2000)
    page.wait(lambda d: len(page.spans()) >= 3, ANSWER_TIMEOUT_S)
    fault_server.proc.send_signal(signal.SIGTERM)  # the answer ends with an error event, then the server exits
    page.wait(lambda d: page.last_state() == "error" and page.idle(), 30)
    assert "cut short" in page.error() and "shutting down" in page.error()
    assert fault_server.proc.wait(30) == 0
    page.send(PROMPT, "parent")
    page.wait(lambda d: "Lost the connection" in page.error() and page.idle(), 30)

