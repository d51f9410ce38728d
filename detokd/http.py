"""A few GET routes on a thread of their own: the plumbing of /health, /metrics, /status.

A route is a function returning (status, body, content type), called on the HTTP
thread: it must only read what the loop publishes, never call into the loop. Request
errors go to the rate-limited logger: socketserver would print each one's traceback
straight to stderr, and a scraper that resets its connections would write kilobytes
per scrape, past every limit.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .logs import RateLimitFilter

log = logging.getLogger("detokd.http")
# What clients do (hang up mid-request, by the hundred) chooses what this logs: limited
# here too, so it stays bounded even without logs.setup (detokd as a library).
log.addFilter(RateLimitFilter())

Reply = tuple[int, bytes, str]


class QuietHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # socketserver's 5 makes a burst of scrapes wait out SYN retries

    def handle_error(self, request, client_address) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):  # the client hung up: not our bug
            log.info("http client %s: %s", client_address[0], type(exc).__name__)
        else:
            log.warning("http request from %s failed", client_address[0], exc_info=True)


class Endpoint:
    """Serve `routes` (path -> reply function) on host:port; `port` is the bound one."""

    def __init__(self, host: str, port: int, routes: dict[str, Callable[[], Reply]], name: str) -> None:
        class Handler(BaseHTTPRequestHandler):
            timeout = 10  # a client that connects and never sends a request lets go of its thread

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                route = routes.get(self.path.split("?")[0])
                code, body, ctype = route() if route is not None else (404, b"not found\n", "text/plain")
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # requests are not worth a log line
                pass

        self.httpd = QuietHTTPServer((host, port), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
