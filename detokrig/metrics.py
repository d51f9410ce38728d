"""detokd's HTTP side as the tools read it: the port, /metrics, /health."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

from detokd.process import DetokdProcess

from .waits import wait_until

Metrics = dict[str, "float | dict[str, float]"]


def metrics_port(d: DetokdProcess, timeout: float = 30.0) -> int:
    """The port a detokd told `metrics_port = 0` picked: it logs it before READY=1."""
    found = wait_until(lambda: re.search(r"health and metrics on port (\d+)", d.log()), timeout, "metrics port in the log")
    return int(found.group(1))


def get(port: int, path: str, timeout: float = 10.0) -> tuple[int, str]:
    """(status, body) of GET http://127.0.0.1:port/path; an HTTP error status is an
    answer too, a failed connection raises OSError."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def scrape(port: int, timeout: float = 10.0) -> Metrics:
    """/metrics through the Prometheus parser: an unlabelled sample by its name, a
    labelled one as {label value: value} under its name (labels "k=v,..." where there
    are several). Histogram buckets are left out (their _sum and _count stay)."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = get(port, "/metrics", timeout)
    if status != 200:
        raise OSError(f"/metrics answered {status}: {body[:200]}")
    out: Metrics = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            if not s.labels:
                out[s.name] = s.value
                continue
            label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) if len(s.labels) > 1 else next(iter(s.labels.values()))
            out.setdefault(s.name, {})[label] = s.value
    return out
