"""A loopback reverse proxy that shows the embedded server to the harness as a real service would look.

It forwards every request to the embedded server unchanged and hides the server's marker on the
way back: the `X-Embedded-Tinker-Server` header and every `embedded_server` key of a JSON answer
(the capabilities carry one). The harness behind it cannot tell it is talking to the embedded
server, so the launch scope and every other "real service" path run as they would on Spindle;
get_info still names the stand-in that computes, so the run is a rehearsal all the same.

It lives in the tests on purpose: no server option a user can pass hides the marker, so no
user-facing path can present a stand-in as the real model. Run by hand:

    python tests/support/marker_hiding_proxy.py --upstream http://127.0.0.1:8123 --port 8124
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

MARKER_HEADER = "x-embedded-tinker-server"
MARKER_KEY = "embedded_server"
# Hop-by-hop headers (RFC 9110 section 7.6.1) and the ones the proxy recomputes.
_NOT_FORWARDED = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-authenticate",
        "host",
        "content-length",
        "content-encoding",
        MARKER_HEADER,
    }
)


def without_marker(value: Any) -> Any:
    """`value` (decoded JSON) with every `embedded_server` key removed, at any depth."""
    if isinstance(value, dict):
        return {k: without_marker(v) for k, v in value.items() if k != MARKER_KEY}
    if isinstance(value, list):
        return [without_marker(v) for v in value]
    return value


def hide_marker(body: bytes, content_type: str) -> bytes:
    """A response body as the proxy sends it: JSON without the marker keys, anything else as is."""
    if "json" not in content_type.lower() or not body:
        return body
    try:
        decoded = json.loads(body)
    except ValueError:
        return body
    return json.dumps(without_marker(decoded)).encode()


class MarkerHidingProxy(ThreadingHTTPServer):
    """Forwards everything to `upstream`; counts requests and the markers it hid."""

    daemon_threads = True

    def __init__(self, upstream: str, port: int = 0):
        self.upstream = upstream.rstrip("/")
        self.requests = 0
        self.hidden_headers = 0
        self._lock = threading.Lock()
        # Long polls stay open for the SDK's poll window; the upstream's own bounds apply.
        self.client = httpx.Client(timeout=httpx.Timeout(300.0, connect=10.0), trust_env=False)
        super().__init__(("127.0.0.1", port), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
        """A client that hangs up (a stopped run abandons its polls) is not a proxy error."""
        import sys

        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)

    def count(self, *, hid_header: bool) -> None:
        with self._lock:
            self.requests += 1
            self.hidden_headers += int(hid_header)

    def server_close(self) -> None:
        super().server_close()
        self.client.close()


class _Handler(BaseHTTPRequestHandler):
    server: MarkerHidingProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # the upstream logs requests; keep test output clean
        pass

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(length) if length else b""
        # A request body stays as sent (a zstd forward_backward keeps its Content-Encoding); a
        # response's is decoded by httpx, so its encoding header is not passed on.
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _NOT_FORWARDED - {"content-encoding"}}
        try:
            resp = self.server.client.request(
                self.command, self.server.upstream + self.path, headers=headers, content=data
            )
        except httpx.HTTPError as e:
            self._send(
                502,
                {"content-type": "application/json"},
                json.dumps({"error": f"proxy: upstream unreachable ({type(e).__name__})"}).encode(),
            )
            return
        self.server.count(hid_header=MARKER_HEADER in {k.lower() for k in resp.headers})
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _NOT_FORWARDED}
        self._send(resp.status_code, out_headers, hide_marker(resp.content, resp.headers.get("content-type", "")))

    def _send(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _forward


@contextmanager
def marker_hiding_proxy(upstream: str) -> Iterator[MarkerHidingProxy]:
    """A running proxy in front of `upstream`, shut down (and its port closed) on exit."""
    proxy = MarkerHidingProxy(upstream)
    thread = threading.Thread(target=proxy.serve_forever, name="marker-hiding-proxy", daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", required=True, help="the embedded server's URL")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    proxy = MarkerHidingProxy(args.upstream, args.port)
    print(f"marker-hiding proxy on {proxy.url} -> {proxy.upstream}", flush=True)
    try:
        proxy.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        proxy.server_close()


if __name__ == "__main__":
    main()
