"""The chat page in a real headless browser: Debian's `chromium`, driven over the
DevTools protocol with `websocket-client` (pinned in the test extra; no browser download),
against `cedlm serve` with the shipped model (it has a vision tower).

The page is loaded from the server; a message is typed and sent; the reply streams into the DOM
and, once finished, equals the non-streaming greedy answer to the same conversation. Then a new
chat with an image of a handwritten digit (scikit-learn's digits, docs/vision.md's held-out 7) is sent
through the page's file input; the reply equals the API's answer to the same image and names the
digit. Then: Stop keeps the partial reply as an ordinary turn, and the next message sends both
turns; Regenerate replaces a reply with a new one for the same conversation; conversations
survive a reload and can be switched and deleted; the markdown renderer draws code, emphasis,
lists and safe links while model text never becomes markup (no script runs, no javascript: link).
A screenshot is taken (written to `$CEDLM_CHAT_PAGE_SCREENSHOT` when set: that is how
docs/chat-page.png is made).

Without chromium the test skips (fails when CEDLM_REQUIRE_CHROMIUM=1, as .ci/run sets after
installing it). About 30 s.
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
                seen.append(self.js("$('log').lastElementChild?.children[1]?.textContent ?? ''"))
            if v:
                return v
            assert time.monotonic() < deadline, f"timed out waiting for {expr}"
            time.sleep(0.02)

    def reload(self):
        self.call("Page.reload")
        time.sleep(0.2)
        self.wait("document.readyState === 'complete' && $('model').value !== ''")


# the last assistant turn on the page: its raw text (what the model sent), stats and error state
LAST = ("(() => { const o = [...$('log').querySelectorAll('.msg.assistant')].pop(); return {answer: "
        "o.children[1].dataset.raw, stats: o.children[2].textContent, error: o.classList.contains('error')}; })()")
STORED = "JSON.parse(localStorage.getItem('cedlm.conversations')).find(c => c.id === localStorage.getItem('cedlm.current'))"
# every request body the page sends, kept in window.sent
SPY = ("window.sent = []; if (!window.realFetch) { window.realFetch = window.fetch; window.fetch = (u, o) => "
       "{ if (o && o.body) window.sent.push(JSON.parse(o.body)); return window.realFetch(u, o); }; } true")


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
    return page.js(LAST)


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


def test_stop_keeps_the_partial_reply_and_the_history(server, page):
    page.js("$('clear').click(); $('max_tokens').value = '200'; $('temperature').value = '0'; "
            "$('effort').value = 'none'; true")
    page.js(SPY)
    for attempt in range(3):                     # the reply must still be streaming when Stop is pressed
        page.js("$('clear').click(); window.sent = []; $('input').value = 'Tell me a long story about the sea.'; "
                "$('form').requestSubmit(); true")
        page.wait("(() => { const a = [...$('log').querySelectorAll('.msg.assistant')].pop(); "
                  "return a && a.children[1].dataset.raw.length > 0; })()")
        page.js("$('send').click(); true")           # the Send button is Stop while a reply streams
        page.wait("$('send').textContent === 'Send'")
        got = page.js(LAST)
        if "stopped" in got["stats"]:
            break
    print("stopped reply:", got)
    assert "stopped" in got["stats"] and not got["error"] and got["answer"]
    stored = page.js(STORED)["messages"]
    assert [(m["role"], m["content"]) for m in stored] == [
        ("user", "Tell me a long story about the sea."), ("assistant", got["answer"])]
    assert not any(m.get("error") or m.get("streaming") for m in stored)

    # the next message carries both turns
    page.js("$('max_tokens').value = '16'; true")
    ask(page, "And then?", [])
    sent = page.js("window.sent")[-1]["messages"]
    assert sent == [{"role": "user", "content": "Tell me a long story about the sea."},
                    {"role": "assistant", "content": got["answer"]}, {"role": "user", "content": "And then?"}]
    assert len(page.js(STORED)["messages"]) == 4

    # Regenerate (greedy): the same conversation is sent again and the new reply replaces the old
    before = page.js(LAST)
    page.js("[...$('log').querySelectorAll('.msg.assistant')].pop().querySelector('button.regenerate').click(); true")
    time.sleep(0.1)
    page.wait("$('send').textContent === 'Send'")
    after = page.js(LAST)
    assert page.js("window.sent")[-1]["messages"] == sent
    assert after["answer"] == before["answer"] and not after["error"]
    assert len(page.js(STORED)["messages"]) == 4 and page.js("$('log').querySelectorAll('.msg').length") == 4
    assert page.js("[...$('log').querySelectorAll('.msg.assistant button.copy')].length") == 2
    page.js("[...$('log').querySelectorAll('.msg.assistant')].pop().querySelector('button.copy').click(); true")
    page.wait("[...$('log').querySelectorAll('.msg.assistant')].pop().querySelector('button.copy').textContent "
              "=== 'Copied'", timeout=10)


XSS = [
    "<script>window.pwned = 1</script>",
    "<img src=x onerror=\"window.pwned = 2\">",
    "[click](javascript:window.pwned=3) [again](JaVaScRiPt:window.pwned=4) [data](data:text/html,x)",
    "[quote\" onmouseover=\"window.pwned=5](https://example.com/\"onclick=\"window.pwned=6)",
    "`<b>inline</b>` and **<i>bold</i>**",
]
MARKDOWN = "\n".join([
    "# Title", "Some **bold**, *italic* and `code` with a [link](https://example.com/a_b).", "",
    "- one", "- two", "", "1. first", "2. second", "", "> quoted", "", "```python", "def f(x):",
    "    return x < 2 and x > 0", "```", "", *XSS])


def test_markdown_is_rendered_and_never_becomes_markup(server, page):
    html = page.js(f"renderMarkdown({json.dumps(MARKDOWN)})")
    for tag in ("<strong>bold</strong>", "<em>italic</em>", "<code>code</code>", "<ul><li>one</li><li>two</li></ul>",
                "<ol><li>first</li><li>second</li></ol>", "<blockquote>quoted</blockquote>",
                "<pre><code>def f(x):\n    return x &lt; 2 and x &gt; 0</code></pre>",
                '<a href="https://example.com/a_b" target="_blank" rel="noopener noreferrer">link</a>',
                "&lt;script&gt;", "<code>&lt;b&gt;inline&lt;/b&gt;</code>"):
        assert tag in html, (tag, html)
    assert "<script" not in html and "<img" not in html and "<b>" not in html and "<i>" not in html
    assert "javascript:" not in html.lower().replace("[click](javascript:", "").replace("[again](javascript:", "")
    # in the page: a stored conversation with those replies, drawn after a reload
    conv = {"id": "xss", "title": "<img src=x onerror=window.pwned=7>", "updated": 1, "messages": [
        {"role": "user", "content": "<img src=x onerror=\"window.pwned = 8\">"},
        {"role": "assistant", "content": MARKDOWN}]}
    page.js(f"localStorage.setItem('cedlm.conversations', JSON.stringify([{json.dumps(conv)}, "
            f"...JSON.parse(localStorage.getItem('cedlm.conversations'))])); "
            f"localStorage.setItem('cedlm.current', 'xss'); true")
    page.reload()
    time.sleep(0.3)                               # an onerror handler would have run by now
    assert page.js("window.pwned === undefined")
    assert page.js("$('log').querySelectorAll('script, img, iframe, [onerror], [onclick], [onmouseover]').length") == 0
    links = page.js("[...$('log').querySelectorAll('a')].map(a => a.getAttribute('href'))")
    assert links and all(h.startswith("https://") for h in links), links
    assert page.js("$('log').querySelector('.answer pre code').textContent").startswith("def f(x):")
    assert page.js("$('log').querySelector('.msg.user').textContent") == conv["messages"][0]["content"]
    assert page.js("$('convs').querySelector('li.current .open').textContent") == conv["title"]


def test_conversations_survive_a_reload_and_can_be_switched_and_deleted(server, page):
    page.reload()
    titles = page.js("[...$('convs').querySelectorAll('.open')].map(b => b.textContent)")
    assert {"Say hello.", "What digit is this?", "Tell me a long story about the sea."} <= set(titles), titles
    page.js("[...$('convs').querySelectorAll('li')].find(li => li.textContent.startsWith('Say hello.'))"
            ".querySelector('.open').click(); true")
    assert page.js("$('log').querySelector('.msg.user').textContent") == "Say hello."
    assert page.js(LAST)["answer"] == greedy(server, [{"role": "user", "content": "Say hello."}], 24)
    n = len(titles)
    page.js("$('convs').querySelector('li[data-id=xss] .delete').click(); true")
    page.reload()
    assert page.js("$('convs').querySelectorAll('li').length") == n - 1
    assert page.js("$('convs').querySelector('li[data-id=xss]') === null")
    assert "xss" not in page.js("localStorage.getItem('cedlm.conversations')")
