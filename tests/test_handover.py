"""Replacing a detokd under load without losing a request (docs/deploy.md, "Restarting
under load"): ZMQ acknowledges nothing, so a stop at a fixed address loses what the
scheduler had written to the connection and detokd had not read. The handover the docs
give instead, between real processes: the replacement starts on a new address, new
requests go to it, the old detokd finishes the requests it has and is stopped."""

from __future__ import annotations

import random

import msgspec
from utils import Engine, Req, Sink, make_ids

from detokd.process import DetokdProcess, ipc_config


def started(folder, worker: str) -> DetokdProcess:
    folder.mkdir(mode=0o700)
    cfg = msgspec.structs.replace(ipc_config(folder, log_level="info"), workers=[worker])
    return DetokdProcess(cfg, folder=folder).start()


def stream(engine: Engine, reqs: list[Req], rng: random.Random, until: float = 1.0) -> None:
    """Send each request's rows, 1-4 ids a row, interleaved in batches, until `until` of
    every request's ids are sent (1.0: finished)."""
    while True:
        live = [r for r in reqs if r.pos < len(r.ids) * until]
        if not live:
            return
        engine.rows([r.row(rng.randint(1, 4)) for r in rng.sample(live, min(len(live), 32))])


def test_a_replacement_on_a_new_address_takes_over_and_every_request_is_answered_once(tmp_path, zctx):
    rng = random.Random(7)
    worker = f"ipc://{tmp_path}/worker.sock"
    sink = Sink(zctx, worker)
    old = started(tmp_path / "old", worker)
    to_old = Engine(zctx, old.config.input)
    before = [Req(f"old-{k}", make_ids(rng, 60)) for k in range(200)]
    stream(to_old, before, rng, until=0.5)  # each request half sent, all in flight

    new = started(tmp_path / "new", worker)  # 1. the replacement, on a new address
    to_new = Engine(zctx, new.config.input)
    after = [Req(f"new-{k}", make_ids(rng, 60)) for k in range(200)]
    stream(to_new, after[:100], rng, until=0.5)  # new requests go to it,
    stream(to_old, before, rng)  # 2. while the old one finishes its own,
    stream(to_new, after, rng)
    sink.wait(lambda: all(sink.ended(r.rid) for r in before), 60, "the old detokd's requests finished")
    assert old.stop() == 0  # then it is stopped

    sink.wait(lambda: all(sink.ended(r.rid) for r in after), 60, "the replacement's requests finished")
    for r in before + after:
        rows = sink.rows(r.rid)
        assert [row["error"] for row in rows if row["error"]] == [], r.rid
        assert sum(row["finish"] is not None for row in rows) == 1, r.rid  # answered once
        assert sink.text(r.rid) == r.expected(), r.rid
    assert new.stop() == 0
