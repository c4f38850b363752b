"""The chat page in a real headless browser: Debian's `chromium`, driven over the
DevTools protocol with `websocket-client` (pinned in the test extra; no browser download),
against `cedlm serve` with the shipped model (it has a vision tower).

The page is loaded from the server; a message is typed and sent; the reply streams into the DOM
and, once finished, equals the non-streaming greedy answer to the same conversation. Then a new
chat with an image of a handwritten digit (scikit-learn's digits, docs/vision.md's held-out 7) is sent
through the page's file input; the reply equals the API's answer to the same image and names the
digit. A screenshot is taken (written to `$CEDLM_CHAT_PAGE_SCREENSHOT` when set: that is how
docs/chat-page.png is made).

Without chromium the test skips (fails when CEDLM_REQUIRE_CHROMIUM=1, as .ci/run sets after
installing it). About 20 s.
"""
from __future__ import annotations

import base64
import io
import itertools
import json
import os
import re
import shutil
import subprocess
import time

import pytest

httpx = pytest.importorskip("httpx")
websocket = pytest.importorskip("websocket", reason="websocket-client is not installed (the test extra)")

from conftest import cedlm_serve, stop_process, tool_unavailable  # noqa: E402

DIGIT_INDEX, DIGIT = 374, "7"            # docs/vision.md's held-out handwritten 7


def chromium_exe() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        tool_unavailable("CEDLM_REQUIRE_CHROMIUM",
                         "chromium is not installed (Debian: apt-get install -y chromium; .ci/run installs it)")
    return exe


class Page:
    """One browser tab over the DevTools protocol: `call(method, **params)` -> result."""

    def __init__(self, ws_url: str):
        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.ids = itertools.count(1)

    def call(self, method: str, **params):
        i = next(self.ids)
        self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == i:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def js(self, expr: str):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, expr: str, timeout: float = 60.0, seen: list | None = None):
        deadline = time.monotonic() + timeout
        while True:
            v = self.js(expr)
            if seen is not None:
                seen.append(self.js("$('log').lastElementChild ? $('log').lastElementChild.children[1].textContent : ''"))
            if v:
                return v
            assert time.monotonic() < deadline, f"timed out waiting for {expr}"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`cedlm serve` with the shipped model on a free loopback port."""
    with cedlm_serve(tmp_path_factory.mktemp("serve") / "serve.log") as base:
        yield base


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    exe = chromium_exe()
    prof = tmp_path_factory.mktemp("chromium")
    proc = subprocess.Popen([exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                             "--disable-extensions", "--disable-dev-shm-usage", "--window-size=1000,800",
                             "--remote-debugging-port=0", f"--user-data-dir={prof}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        deadline = time.monotonic() + 30
        while port is None and time.monotonic() < deadline and proc.poll() is None:
            m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", proc.stderr.readline())
            port = m and int(m.group(1))
        assert port, "chromium did not open its DevTools port"
        tabs = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        tab = next(t for t in tabs if t["type"] == "page")
        p = Page(tab["webSocketDebuggerUrl"])
        p.call("Runtime.enable")
        yield p
        p.ws.close()
    finally:
        stop_process(proc, 10)


def digit_png(path) -> bytes:
    np = pytest.importorskip("numpy")
    datasets = pytest.importorskip("sklearn.datasets", reason="scikit-learn (the train extra) draws the digit")
    from PIL import Image
    img = datasets.load_digits().images[DIGIT_INDEX]
    b = io.BytesIO()
    Image.fromarray(np.round(img * 255 / 16).astype("uint8")).save(b, "PNG")
    path.write_bytes(b.getvalue())
    return b.getvalue()


def ask(page: Page, text: str, streamed: list) -> dict:
    """Type `text`, send it, wait for the reply; -> the last reply's answer, stats and class."""
    n = page.js("$('log').children.length")
    page.js(f"$('input').value = {json.dumps(text)}; $('form').requestSubmit(); true")
    page.wait(f"$('log').children.length >= {n + 2} && $('send').textContent === 'Send'", seen=streamed)
    return page.js("(() => { const o = $('log').lastElementChild; return {answer: o.children[1].textContent, "
                   "stats: o.children[2].textContent, error: o.classList.contains('error')}; })()")


def greedy(base: str, messages: list, max_tokens: int) -> str:
    r = httpx.post(base + "/v1/chat/completions", timeout=120, json={
        "messages": messages, "max_tokens": max_tokens, "temperature": 0, "reasoning_effort": "none"})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"].get("content") or ""


def test_chat_page_in_chromium(server, page, tmp_path):
    page.call("Page.enable")
    page.call("Page.navigate", url=server + "/")
    page.wait("document.readyState === 'complete' && $('model').value !== ''")
    page.js("$('max_tokens').value = '24'; $('temperature').value = '0'; $('effort').value = 'none'; true")

    # 1. a message: the reply streams into the DOM and equals the greedy API answer
    streamed: list[str] = []
    got = ask(page, "Say hello.", streamed)
    want = greedy(server, [{"role": "user", "content": "Say hello."}], 24)
    print("chat page reply:", got, "| states seen while streaming:", len(set(streamed)))
    assert not got["error"], got
    assert got["answer"] == want and want
    assert re.search(r"\d+ tokens, [0-9.]+ tokens/s, first token [0-9.]+ s, finish: (stop|length)", got["stats"])

    # 2. a new chat with an image of a digit, through the page's file input
    png = tmp_path / "digit.png"
    data = digit_png(png)
    page.js("$('clear').click(); $('max_tokens').value = '8'; true")
    doc = page.call("DOM.getDocument")
    node = page.call("DOM.querySelector", nodeId=doc["root"]["nodeId"], selector="#image")["nodeId"]
    page.call("DOM.setFileInputFiles", files=[str(png)], nodeId=node)
    got = ask(page, "What digit is this?", [])
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    want = greedy(server, [{"role": "user", "content": [{"type": "text", "text": "What digit is this?"},
                                                        {"type": "image_url", "image_url": {"url": url}}]}], 8)
    print("chat page image reply:", got)
    assert not got["error"], got
    assert page.js("$('log').querySelector('.msg.user img') !== null")          # the image is shown
    assert got["answer"] == want and DIGIT in want

    # 3. a screenshot
    shot = base64.b64decode(page.call("Page.captureScreenshot", format="png")["data"])
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 5000
    dest = os.environ.get("CEDLM_CHAT_PAGE_SCREENSHOT")
    if dest:
        with open(dest, "wb") as f:
            f.write(shot)
