"""What an SRE's tools read from a real `detokd serve`: the process collector and build
info on /metrics, help strings that say what is counted, HEAD, the liveness/readiness
split (docs/deploy.md, "Metrics"), and the supervisor's own /metrics under --shards."""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import socket
from pathlib import Path

import tokenizers
from prometheus_client.parser import text_string_to_metric_families
from utils import http_get, metric, metrics_port, scrape, wait_until

from detokd import __version__

DEPLOY = (Path(__file__).parent.parent / "docs" / "deploy.md").read_text()


def head(port: int, path: str) -> bytes:
    """The whole answer to a HEAD request, as the endpoint sends it before closing."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(f"HEAD {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_metrics_carry_the_process_collector_build_info_and_answer_head(detokd):
    d = detokd(args=["--metrics-port", "0"])
    d.wait_ready()
    port = metrics_port(d)
    m = scrape(port)
    assert metric(m, "process_resident_memory_bytes") > 10 << 20  # a tokenizer is loaded
    assert metric(m, "process_open_fds") > 3
    assert metric(m, "process_cpu_seconds_total") > 0
    assert metric(m, "process_start_time_seconds") > 0
    labels = {"version": __version__, "python": platform.python_version(), "tokenizers": tokenizers.__version__, "dialect": "native"}
    assert metric(m, "detokd_build_info", **labels) == 1
    for path in ("/health", "/livez", "/readyz", "/metrics"):
        answer = head(port, path)
        status, _, rest = answer.partition(b"\r\n")
        assert status == b"HTTP/1.0 200 OK", (path, answer[:200])
        headers, _, body = rest.partition(b"\r\n\r\n")
        assert body == b"", path  # HEAD: the headers of GET, no body
        assert int(re.search(rb"Content-Length: (\d+)", headers).group(1)) > 0, path
    assert head(port, "/nothing").startswith(b"HTTP/1.0 404 ")
    assert d.stop() == 0


def test_every_help_string_is_the_documented_what_it_counts(detokd):
    """HELP of each detokd_ family is docs/deploy.md's "what it counts" cell, backticks
    dropped: the scraper's tooltip and the docs say the same thing."""
    d = detokd(args=["--metrics-port", "0"])
    d.wait_ready()
    body = http_get(metrics_port(d), "/metrics")[1].decode()
    helps = dict(re.findall(r"^# HELP (detokd_\w+) (.*)$", body, re.M))
    documented = {
        name: what.replace("`", "")
        for name, what in re.findall(r"^\| `(detokd_[a-z_]+)` \| [^|]* \| ([^|]*) \|", DEPLOY, re.M)
    }
    for name, help_text in helps.items():
        scraped = name + "_total" if name + "_total" in documented else name
        assert help_text == documented[scraped], name
    assert d.stop() == 0


def test_livez_fails_only_when_stuck_and_readyz_also_while_stopping(detokd, zctx):
    """Stopping with a frame still to drain: /readyz says 503 stopping (send no more
    traffic) while /livez says 200 (do not restart a process finishing its work)."""
    d = detokd(args=["--metrics-port", "0"], stallable=True, health_timeout=60.0, shutdown_grace_s=60.0)
    d.wait_ready()
    port = metrics_port(d)
    assert http_get(port, "/livez") == (200, b"ok\n")
    assert http_get(port, "/readyz") == (200, b"ok\n")
    d.stall_when_stopping(4)  # the loop, once stopping, is busy for 4 s
    d.stall(3)
    wait_until(lambda: metric(scrape(port), "detokd_loop_idle_seconds") > 0.3, 10, "the stall to begin")
    d.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: http_get(port, "/readyz") == (503, b"stopping\n"), 20, "/readyz to say stopping")
    assert http_get(port, "/livez") == (200, b"ok\n")
    assert d.proc.wait(30) == 0


def test_livez_and_readyz_fail_while_the_loop_is_stuck(detokd, zctx):
    d = detokd(args=["--metrics-port", "0"], stallable=True, health_timeout=0.5)
    d.wait_ready()
    port = metrics_port(d)
    d.stall(3)
    _, body = wait_until(lambda: (lambda r: r[0] == 503 and r)(http_get(port, "/livez")), 10, "/livez 503")
    assert b"stuck" in body
    assert http_get(port, "/readyz")[0] == 503
    wait_until(lambda: http_get(port, "/livez")[0] == 200, 10, "/livez 200 after the stall")
    assert d.stop() == 0


def supervisor_port(d) -> int:
    m = wait_until(lambda: re.search(r"supervisor health and status on port (\d+)", d.log()), 30, "the supervisor's port")
    return int(m.group(1))


def test_the_supervisor_serves_metrics_of_its_shards_and_itself(detokd):
    """Two shards: shards up 2, no restarts; a shard killed is restarted, and the
    supervisor's /metrics counts it, with its own process_* and build info."""
    d = detokd(args=["--shards", "2", "--supervisor-port", "0"])
    d.wait_ready()
    port = supervisor_port(d)
    m = scrape(port)
    assert metric(m, "detokd_supervisor_shards_up") == 2
    assert metric(m, "detokd_supervisor_restarts_total", shard="0") == 0
    assert metric(m, "detokd_supervisor_crash_looping", shard="1") == 0
    assert metric(m, "process_resident_memory_bytes") > 0
    assert metric(m, "detokd_build_info", version=__version__, python=platform.python_version(),
                  tokenizers=tokenizers.__version__, dialect="native") == 1
    pid = json.loads(http_get(port, "/status")[1])["shards"][1]["pid"]


    os.kill(pid, signal.SIGKILL)
    m = wait_until(
        lambda: (lambda m: metric(m, "detokd_supervisor_restarts_total", shard="1") == 1
                 and metric(m, "detokd_supervisor_shards_up") == 2 and m)(scrape(port)),
        30, "shard 1 restarted",
    )
    assert metric(m, "detokd_supervisor_restarts_total", shard="0") == 0
    body = http_get(port, "/metrics")[1].decode()
    for fam in text_string_to_metric_families(body):
        if fam.name.startswith("detokd_supervisor"):
            assert f"- `{fam.name}{'_total' if fam.type == 'counter' else ''}` ({fam.type}): {fam.documentation}." in DEPLOY, fam.name
    assert d.stop() == 0
