"""Fetching a remote `image_url` (only with `cedlm serve --allow-remote-images`) without letting
a client reach what the server can reach.

`fetch(url, max_bytes, timeout)` gets an http(s) URL's body under these rules:

- The host is resolved once and every address it resolves to must be a public unicast address
  (`public_address`): loopback, private, link-local, shared (100.64/10), multicast, reserved,
  unspecified, documentation and other special-purpose ranges are refused, and so is an IPv6
  address that embeds one (IPv4-mapped, 6to4, Teredo, NAT64). The connection goes to the address
  that was checked (the `Host` header and TLS name stay the URL's), so a second DNS answer cannot
  swap in another one (DNS rebinding).
- A host written as a number other than a dotted quad (`2130706433`, `0x7f.1`, `0177.0.0.1`,
  `127.1`) is refused before resolution: parsers disagree about what it means.
- At most `MAX_REDIRECTS` redirects, each target checked the same way; no credentials in the URL.
- One deadline for everything (DNS, connecting, TLS, headers, body: `timeout` seconds) and a byte
  cap (`max_bytes`, checked on `content-length` and while reading); the answer must be a 200.

Every failure is the same `FetchError` with the same message, whatever the reason (an address
refused, a closed port, a timeout, too many bytes, a 404), so a client cannot use the server to
learn which hosts and ports exist; the reason is logged (logger "cedlm.server", INFO).
"""
from __future__ import annotations

import concurrent.futures
import http.client
import ipaddress
import logging
import re
import socket
import ssl
import threading
import time
import urllib.parse
from typing import Callable

log = logging.getLogger("cedlm.server")

MAX_REDIRECTS = 3
_NUMERIC_LABEL = re.compile(r"[0-9]+|0[xX][0-9a-fA-F]*")   # a host ending in one is an address (WHATWG URL)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_dns = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="cedlm-dns")


class FetchError(ValueError):
    """A remote image could not be fetched (one message for every reason; see the module doc)."""


def public_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """True for a public unicast address the server may connect to on a client's behalf."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = [ip.ipv4_mapped, ip.sixtofour] + list(ip.teredo or ())
        if ip in _NAT64:
            embedded.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if any(v is not None and not public_address(v) for v in embedded):
            return False
        if ip.ipv4_mapped is not None:
            return True
    return bool(ip.is_global and not (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
                                      or ip.is_reserved or ip.is_unspecified))


class _Refused(Exception):
    """Why a fetch failed (logged, never shown to the client)."""


def _resolve(host: str, port: int, deadline: float, allowed: Callable) -> str:
    """The address to connect to: every address `host` resolves to must be allowed."""
    try:
        literal = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        literal = None
    if literal is None and _NUMERIC_LABEL.fullmatch(host.rstrip(".").rsplit(".", 1)[-1]):
        raise _Refused(f"numeric host {host!r} is not a dotted-quad IPv4 address")
    if literal is not None:
        infos = [str(literal)]
    else:
        fut = _dns.submit(socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)
        try:
            got = fut.result(timeout=max(deadline - time.monotonic(), 0.001))
        except concurrent.futures.TimeoutError:
            raise _Refused(f"resolving {host!r} took longer than the deadline") from None
        except OSError as e:
            raise _Refused(f"cannot resolve {host!r}: {e}") from None
        infos = [ai[4][0] for ai in got]
    if not infos:
        raise _Refused(f"{host!r} resolves to no address")
    for a in infos:
        ip = ipaddress.ip_address(a.split("%")[0])
        if not allowed(ip):
            raise _Refused(f"{host!r} resolves to {ip}, not a public address")
    return infos[0]


class _Pinned(http.client.HTTPConnection):
    """An HTTP connection to a given address, with the URL's host in the Host header."""

    def __init__(self, host, port, address, timeout):
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self):
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedTLS(http.client.HTTPSConnection):
    """As `_Pinned`, over TLS verified against the URL's host name."""

    def __init__(self, host, port, address, timeout):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self.address = address

    def connect(self):
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def _get(url: str, max_bytes: int, deadline: float, allowed: Callable) -> bytes | str:
    """The body of a 200, or the URL a redirect points to."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise _Refused(f"not an http(s) URL with a host: {url[:100]!r}")
    if u.username is not None or u.password is not None:
        raise _Refused("credentials in the URL")
    try:
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        raise _Refused("invalid port") from None
    address = _resolve(u.hostname, port, deadline, allowed)

    def left() -> float:
        t = deadline - time.monotonic()
        if t <= 0:
            raise _Refused("the deadline passed")
        return t
    conn = (_PinnedTLS if u.scheme == "https" else _Pinned)(u.hostname, port, address, left())
    watchdog = None
    try:
        conn.connect()
        sock = conn.sock                         # (the response may take it over from conn)
        watchdog = threading.Timer(left(), _cut, [sock])           # a trickle cannot outlast the deadline
        watchdog.daemon = True
        watchdog.start()
        path = urllib.parse.urlunsplit(("", "", u.path or "/", u.query, ""))
        conn.request("GET", path, headers={"User-Agent": "cedlm", "Accept": "image/png, image/jpeg"})
        sock.settimeout(left())
        r = conn.getresponse()
        if r.status in (301, 302, 303, 307, 308) and r.getheader("location"):
            return urllib.parse.urljoin(url, r.getheader("location"))
        if r.status != 200:
            raise _Refused(f"HTTP {r.status}")
        length = r.getheader("content-length")
        if length is not None and length.strip().isdigit() and int(length) > max_bytes:
            raise _Refused(f"content-length {int(length)} over the limit of {max_bytes} bytes")
        chunks, got = [], 0
        while True:
            sock.settimeout(left())
            chunk = r.read1(64 << 10)
            if not chunk:
                break
            got += len(chunk)
            if got > max_bytes:
                raise _Refused(f"more than the limit of {max_bytes} bytes")
            chunks.append(chunk)
            left()
        left()                                   # (the watchdog's cut reads as an early end)
        if length is not None and length.strip().isdigit() and got != int(length):
            raise _Refused(f"{got} of {int(length)} bytes")
        return b"".join(chunks)
    finally:
        if watchdog is not None:
            watchdog.cancel()
        conn.close()


def _cut(sock) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def fetch(url: str, max_bytes: int, timeout: float, allowed: Callable = public_address) -> bytes:
    """The bytes at `url` under the rules of the module docstring; FetchError otherwise."""
    deadline = time.monotonic() + timeout
    try:
        for _ in range(MAX_REDIRECTS + 1):
            got = _get(url, max_bytes, deadline, allowed)
            if isinstance(got, bytes):
                return got
            url = got
        raise _Refused(f"more than {MAX_REDIRECTS} redirects")
    except (_Refused, OSError, http.client.HTTPException, ValueError) as e:
        log.info("remote image not fetched (%s): %s", type(e).__name__, e)
        raise FetchError(message(max_bytes, timeout)) from None


def message(max_bytes: int, timeout: float) -> str:
    """The one message of every failed fetch."""
    return (f"image_url: could not fetch image_url (it must be a public http(s) URL answering 200 with "
            f"at most {max_bytes} bytes within {timeout:g} s)")
