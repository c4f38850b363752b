"""Remote image URLs (`--allow-remote-images`): only public addresses, one deadline, a byte cap,
one generic error; and the image count and pixel count checked before any fetch or decode.

A local HTTP server stands in for the internet: the default address policy must refuse it (it is
loopback) without ever connecting, and a test policy that allows loopback exercises the fetch
itself (deadline, byte cap, redirects, status).
"""
from __future__ import annotations

import http.server
import io
import ipaddress
import threading
import time

import pytest

from cedlm.server import remote_images
from cedlm.server.remote_images import FetchError, fetch, public_address

pytestmark = pytest.mark.foreground    # times wall-clock latencies: see tests/ahead.py

PNG_SIZE = (32, 32)


def _png() -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", PNG_SIZE, (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict = {}
    hits: list = []

    def log_message(self, *a):
        pass

    def do_GET(self):
        self.hits.append((self.path, self.headers.get("host")))
        route = self.routes.get(self.path)
        if route is None:
            self.send_response(404)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        route(self)


@pytest.fixture(scope="module")
def web():
    """A loopback HTTP server: (base URL, routes, hits)."""
    png = _png()

    def ok(h):
        h.send_response(200)
        h.send_header("content-type", "image/png")
        h.send_header("content-length", str(len(png)))
        h.end_headers()
        h.wfile.write(png)

    def big(h):                      # no content-length: the cap is checked while reading
        h.send_response(200)
        h.end_headers()
        for _ in range(64):
            h.wfile.write(b"\0" * 65536)

    def slow(h):                     # a byte every 0.2 s: each read is quick, the whole is not
        h.send_response(200)
        h.end_headers()
        try:
            for _ in range(100):
                h.wfile.write(b"\0")
                h.wfile.flush()
                time.sleep(0.2)
        except OSError:
            pass

    def redirect(to):
        def go(h):
            h.send_response(302)
            h.send_header("location", to)
            h.send_header("content-length", "0")
            h.end_headers()
        return go

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    port = srv.server_address[1]
    _Handler.routes = {"/cat.png": ok, "/big": big, "/slow": slow, "/to-private": redirect("http://10.0.0.1/x.png"),
                       "/to-cat": redirect("/cat.png"), "/loop": redirect("/loop")}
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{port}", port, png, _Handler.hits
    srv.shutdown()


def loopback(ip) -> bool:
    return ip.is_loopback and ip.version == 4


@pytest.mark.parametrize("address,public", [
    ("8.8.8.8", True), ("2001:4860::8888", True), ("::ffff:8.8.8.8", True),
    ("127.0.0.1", False), ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.1", False),
    ("240.0.0.1", False), ("255.255.255.255", False), ("192.0.2.1", False), ("::1", False), ("::", False),
    ("fe80::1", False), ("fc00::1", False), ("ff02::1", False), ("::ffff:127.0.0.1", False),
    ("::ffff:10.0.0.1", False), ("2002:7f00:1::", False), ("64:ff9b::7f00:1", False), ("2001:db8::1", False),
])
def test_only_public_unicast_addresses_are_allowed(address, public):
    assert public_address(ipaddress.ip_address(address)) is public


def test_local_and_numeric_hosts_are_refused_without_connecting(web):
    base, port, _, hits = web
    before = len(hits)
    for host in ("127.0.0.1", "localhost", "2130706433", "0x7f000001", "0x7f.1", "0177.0.0.1", "127.1",
                 "127.0.0.1.", "[::1]", "[::ffff:127.0.0.1]"):
        with pytest.raises(FetchError) as e:
            fetch(f"http://{host}:{port}/cat.png", 1 << 20, 5.0)
        assert str(e.value) == remote_images.message(1 << 20, 5.0)
    assert len(hits) == before                            # the server never saw a request


def test_every_failure_has_the_same_message(web):
    """A closed port, an open one answering 404, a refused address, too many bytes, a redirect to
    a private address, a redirect loop, a name that does not resolve: one message, so a client
    cannot map what the server can reach."""
    base, port, _, hits = web
    closed = _closed_port()
    urls = [f"http://127.0.0.1:{closed}/cat.png", f"{base}/nothing", f"{base}/big", f"{base}/to-private",
            f"{base}/loop", "http://no-such-host.invalid/cat.png", "http://10.0.0.1/cat.png",
            f"http://user:pw@127.0.0.1:{port}/cat.png", "ftp://127.0.0.1/cat.png"]
    messages = set()
    for url in urls:
        with pytest.raises(FetchError) as e:
            fetch(url, 1 << 20, 5.0, allowed=loopback)
        messages.add(str(e.value))
    assert messages == {remote_images.message(1 << 20, 5.0)}
    assert "could not fetch image_url" in messages.pop()
    assert not any(p == "/x.png" for p, _ in hits)        # the private redirect target was not reached


def test_a_fetch_follows_a_redirect_and_keeps_the_host_header(web):
    base, port, png, hits = web
    assert fetch(f"{base}/to-cat", 1 << 20, 5.0, allowed=loopback) == png
    assert hits[-1] == ("/cat.png", f"127.0.0.1:{port}")


def test_one_deadline_bounds_a_trickling_answer(web):
    base, _, _, _ = web
    t0 = time.monotonic()
    with pytest.raises(FetchError):
        fetch(f"{base}/slow", 1 << 20, 1.0, allowed=loopback)
    assert time.monotonic() - t0 < 2.0                    # 100 bytes at 0.2 s would take 20 s


def test_the_byte_cap_stops_reading(web):
    base, _, png, _ = web
    with pytest.raises(FetchError):
        fetch(f"{base}/cat.png", len(png) - 1, 5.0, allowed=loopback)     # by content-length
    assert fetch(f"{base}/cat.png", len(png), 5.0, allowed=loopback) == png


def _closed_port() -> int:
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ------------------------------------------------------------------------- through the server


@pytest.fixture(scope="module")
def remote_server():
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from tests.test_server import serve
    from tests.test_vision_server import _llm

    from cedlm.server.app import create_app
    app = create_app(_llm(), served_model_name="cedlm-vision", allow_remote_images=True)
    with serve(app) as base:
        yield base, app


def _chat(base, urls):
    import httpx
    content = [{"type": "text", "text": "what is it?"}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": "cedlm-vision", "max_tokens": 1, "messages": [{"role": "user", "content": content}]})


def test_the_server_refuses_a_loopback_image_url_with_the_generic_400(remote_server, web):
    base, app = remote_server
    web_base, port, _, hits = web
    before = len(hits)
    for url in (f"{web_base}/cat.png", f"http://localhost:{port}/cat.png", f"http://2130706433:{port}/cat.png",
                f"http://127.0.0.1:{_closed_port()}/cat.png"):
        r = _chat(base, [url])
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "could not fetch image_url" in err["message"] and err["param"] == "messages"
        assert str(port) not in err["message"] and "Refused" not in err["message"]
    assert len(hits) == before
    opts = app.state.server.images
    opts.address_ok = loopback                        # as if the local server were public
    try:
        r = _chat(base, [f"{web_base}/cat.png"])
        assert r.status_code == 200, r.text
    finally:
        opts.address_ok = public_address


def test_the_image_count_is_checked_before_anything_is_fetched(remote_server, web):
    base, app = remote_server
    web_base, _, _, hits = web
    opts = app.state.server.images
    before = len(hits)
    opts.address_ok = loopback
    try:
        r = _chat(base, [f"{web_base}/cat.png"] * (opts.limits.max_images + 1))
    finally:
        opts.address_ok = public_address
    assert r.status_code == 400 and f"limit of {opts.limits.max_images} per request" in r.text, r.text
    assert len(hits) == before


def test_the_pixel_count_is_read_from_the_header_before_decoding(monkeypatch):
    """A 12,000 x 12,000 PNG of a few KB is refused from its header: no pixel is decoded."""
    from PIL import Image

    from tests.test_vision_server import _bomb_png

    from cedlm.text.images import ImageError, ImageLimits, decode_image
    loads = []
    orig = Image.Image.load
    monkeypatch.setattr(Image.Image, "load", lambda self, *a: loads.append(self.size) or orig(self, *a))
    with pytest.raises(ImageError, match="pixels exceed the limit of 40000000"):
        decode_image(_bomb_png(12000, 12000), ImageLimits())
    assert loads == []
    im = decode_image(_png(), ImageLimits())
    assert im.size == PNG_SIZE and loads
