"""The clients around a real `detokd serve`: SchedulerClient in, WorkerClients out.

detokd runs as a process through conftest's `detokd` fixture (DetokdProcess); every
text is checked against the oracle, Vocab.reference of the real DeepSeek tokenizer.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from conftest import oracle, vocab
from utils import arun

from detokd.client import DetokdError, SchedulerClient, WorkerClient, shard_for
from detokd.launch import derive_address
from detokd.wire import native

CORPUS = [
    "Hello, world! This is a test of streaming detokenization.",
    "日本語のテキストを正しく表示できますか？ 中文也是。",
    "한국어 문장과 русский текст, العربية و עברית.",
    "Emoji: 🙂🚀👩‍💻🇫🇷 and combining marks: é ñ ü.",
    "def f(x):\n    return x ** 2  # code with   spaces\n\t\ttabs",
    "   leading spaces, trailing spaces   ",
    "ÀÉÎÕÜ ßæøå ¿¡ «» — … “quotes” ‘single’",
]


def encode(text: str) -> list[int]:
    return vocab("deepseek").backend.encode(text, add_special_tokens=False).ids


def test_many_requests_over_three_workers_one_registered_late_are_exact(detokd, tmp_path: Path) -> None:
    """Many requests, three workers (one added by `register`), random steps: every
    request's text equals the reference decode of the ids sent."""
    v = vocab("deepseek")
    # Worker 2 comes by `register`, which detokd takes only when its config allows it.
    d = detokd(workers=2, register_enabled=True, register_allow=[f"ipc://{tmp_path}/*"])
    inp, workers = d.input, [*d.workers, f"ipc://{tmp_path}/w2.sock"]
    rng = random.Random(1234)
    eos = v.hf.eos_token_id
    specials = [eos, v.backend.token_to_id("<｜fim▁hole｜>")]
    reqs = []
    for i in range(150):
        ids = encode(" ".join(rng.sample(CORPUS, rng.randint(1, 3))))
        if rng.random() < 0.2:  # a special token inside the output
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        prompt = encode(rng.choice(CORPUS))
        tail = prompt[-rng.randint(0, 8):] if rng.random() < 0.8 else []
        stop_token = rng.random() < 0.5
        finish = native.Finish("stop", eos) if stop_token else native.Finish("length")
        if stop_token:
            ids.append(eos)
        skip = rng.random() < 0.7
        out = ids[:-1] if stop_token else ids  # a matched stop token is not rendered
        reqs.append(dict(rid=f"e2e-{i}", ids=ids, tail=tail, finish=finish, skip=skip,
                         worker=i % 3, want=oracle(v, tail, out, skip)))

    async def main() -> dict[str, str]:
        sched = SchedulerClient(inp)
        sched.register(2, workers[2])  # same socket as the rows: detokd knows worker 2 in time
        wcs = [WorkerClient(a) for a in workers]
        streams = {r["rid"]: wcs[r["worker"]].stream(r["rid"]) for r in reqs}
        readers = {rid: asyncio.ensure_future(s.text()) for rid, s in streams.items()}
        pos = {r["rid"]: 0 for r in reqs}
        live = list(reqs)
        while live:
            for r in list(live):
                k = rng.randint(0, 5)
                rid, ids = r["rid"], r["ids"]
                new = ids[pos[rid]:pos[rid] + k]
                done = pos[rid] + len(new) >= len(ids)
                fin = r["finish"] if done else None
                if pos[rid] == 0 and sched.seq_of(rid) is None:
                    sched.begin(rid, new, worker=r["worker"], prompt_tail=r["tail"],
                                skip_special_tokens=r["skip"], finish=fin)
                else:
                    sched.add(rid, new, finish=fin)
                pos[rid] += len(new)
                if done:
                    live.remove(r)
            sched.flush()
            await asyncio.sleep(0.002)  # an engine's step: pacing, not a wait for a result
        got = dict(zip(readers, await asyncio.gather(*readers.values()), strict=True))
        for rid, s in streams.items():
            r = next(q for q in reqs if q["rid"] == rid)
            assert s.finish == r["finish"] and s.n_ids == len(r["ids"]), rid
        sched.close()
        for w in wcs:
            await w.aclose()
        return got

    d.wait_ready()
    got = arun(main(), "uvloop", timeout=40)
    for r in reqs:
        assert got[r["rid"]] == r["want"], (r["rid"], r["ids"], r["tail"], r["skip"])
    assert d.stop() == 0, d.log()[-3000:]


def test_with_two_shards_rids_spread_over_the_derived_inputs_and_text_is_exact(detokd) -> None:
    """`serve --shards 2`: rids spread over derived inputs, text is still exact."""
    v = vocab("deepseek")
    d = detokd(args=["--shards", "2"])
    inputs = [derive_address(d.input, i) for i in range(2)]
    reqs = {f"s{i}": encode(CORPUS[i % len(CORPUS)]) for i in range(40)}
    assert {shard_for(rid, 2) for rid in reqs} == {0, 1}

    async def main() -> dict[str, str]:
        sched = SchedulerClient(inputs)
        async with WorkerClient(d.workers[0]) as w:
            streams = {rid: asyncio.ensure_future(w.stream(rid).text()) for rid in reqs}
            for rid, ids in reqs.items():
                sched.begin(rid, ids[:3])
            sched.flush()
            for rid, ids in reqs.items():
                sched.add(rid, ids[3:], finish=native.Finish("length"))
            sched.flush()
            got = dict(zip(streams, await asyncio.gather(*streams.values()), strict=True))
        sched.close()
        return got

    d.wait_ready()
    got = arun(main(), timeout=40)
    for rid, ids in reqs.items():
        assert got[rid] == v.reference([], ids), rid
    assert d.stop() == 0, d.log()[-3000:]


def test_stopped_reaches_the_client_which_finishes_the_request_so_both_forget_it(detokd, zctx) -> None:
    """detokd finds a stop string: SchedulerClient.stopped() returns the row, the worker
    already has the text up to the stop, and after the next flush (the finishing row
    stopped() queued) neither the client nor detokd holds the request any more."""
    from utils import Sink, metric, metrics_port, scrape, wait_until

    d = detokd(feedback=True, args=["--metrics-port", "0"])
    sink = Sink(zctx, d.workers[0])
    d.wait_ready()
    port = metrics_port(d)
    ids = encode("Hello, world! This is a test of streaming detokenization.")
    with SchedulerClient(d.input, feedback=d.feedback) as sched:
        sched.begin("s1", ids[:1], stop=["world"])
        sched.begin("other", ids[:2], stop=["world"], vid=3)
        sched.flush()
        got, k = [], 1
        while not got:  # one step at a time, as an engine would, until detokd says stop
            assert k < len(ids), "no stopped row though the ids hold the stop string"
            sched.add("s1", ids[k:k + 1])
            sched.flush()
            k += 1
            got = sched.stopped(timeout=0.5 if k > 4 else 0.0)
        [row] = got
        assert (row.rid, row.vid, row.matched) == ("s1", 0, "world")
        assert row.n_ids == len(encode("Hello, world"))
        assert sched.seq_of("s1") is None and len(sched) == 1  # forgotten; "other" is live
        sink.wait(lambda: sink.ended("s1"), 10, "the worker's finishing row")
        assert sink.text("s1") == "Hello, " and sink.rows("s1")[-1]["finish"] == {"reason": "stop", "matched": "world"}
        sched.flush()  # the finishing row stopped() queued
        sched.add("other", [], finish=native.Finish("length"))
        sched.flush()
        sink.wait(lambda: sink.ended("other"), 10, "the other request's end")
        m = wait_until(lambda: (lambda m: metric(m, "detokd_live_requests") == 0 and m)(scrape(port)), 10, "no live request")
        assert metric(m, "detokd_stops_detected_total") == 1
        assert len(sched) == 0
    assert d.stop() == 0


def test_the_scheduler_example_in_client_md_streams_the_text_its_comments_say(detokd, zctx) -> None:
    """docs/client.md's first example, run as written against a real detokd (its
    address swapped in): each row's text is the one its `# text "..."` comment names."""
    import re

    from utils import Sink

    doc = (Path(__file__).parent.parent / "docs" / "client.md").read_text()
    code = doc.split("## Scheduler side", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    said = [json_str(m) for m in re.findall(r'# text ("(?:[^"\\]|\\.)*")', code)]
    assert len(said) == 3, code
    d = detokd()
    sink = Sink(zctx, d.workers[0])
    d.wait_ready()
    code = code.replace('"ipc:///run/engine/detokd.in"', repr(d.input))
    env = {"prompt_ids": encode("Please greet the world.")}
    exec(code, env)  # noqa: S102 (the docs' own example)
    sink.wait(lambda: sink.ended("req-1"), 10, "the example's request to end")
    env["sched"].close()
    assert [r["text"] for r in sink.rows("req-1")] == said
    assert sink.rows("req-1")[-1]["finish"]["reason"] == "stop"
    assert d.stop() == 0


def test_rows_that_follow_a_requests_error_row_are_dropped_and_its_rid_serves_a_new_request(detokd, zctx) -> None:
    """docs/client.md, "Queues and loss": the worker's connection breaks with rows of a
    live request in flight, so detokd fails it (worker_stalled) and sends the error row
    ahead of the rows of it still queued, which follow. A real WorkerClient on the
    address again: its stream raises, those rows are dropped (not kept for a later
    stream), and the rid then serves a new request with exactly the new text."""
    from utils import Engine, Req, metric, metrics_port, pull, scrape, wait_until

    v = vocab("deepseek")
    d = detokd(args=["--metrics-port", "0"])
    old = pull(zctx, d.workers[0], hwm=1, rcvbuf=4096)
    d.wait_ready()
    port = metrics_port(d)
    eng = Engine(zctx, d.input)
    failing = Req("r", encode(" one two three four five six seven eight nine ten" * 8000))
    # The worker reads nothing: ZMQ's queue and the socket buffers fill, then detokd's
    # backlog holds rows of the request too.
    while not metric(scrape(port), "detokd_worker_backlog_messages", worker="0"):
        assert failing.pos < len(failing.ids) // 2, "no backlog"
        eng.rows([failing.row(512)])
    old.close()  # it dies with all of it unread
    wait_until(lambda: metric(scrape(port), "detokd_worker_disconnects_total", worker="0") == 1, 20, "the break seen")
    fresh = encode("A new request that reuses the rid: 世界 🙂.")

    async def main() -> tuple[str, int, int, WorkerClient]:
        async with WorkerClient(d.workers[0]) as w:
            with pytest.raises(DetokdError) as failed:
                await w.stream("r").text()
            assert failed.value.error == native.WORKER_STALLED
            # A request begun after the failure: its rows come after every row detokd had
            # queued before it, so once it has ended all of those are in.
            fence = w.stream("fence")
            eng.rows([Req("fence", encode("fence")).row(10)])
            assert await fence.text() == "fence"
            buffered = w.buffered_rids
            again = w.stream("r")
            eng.rows([Req("r", fresh).row(len(fresh))])
            return await again.text(), again.n_ids, buffered, w

    text, n_ids, buffered, w = arun(main(), timeout=60)
    assert (text, n_ids) == (oracle(v, [], fresh, True), len(fresh))
    assert buffered == 0 and w.stale_rows > 0
    assert d.stop() == 0, d.log()[-3000:]


def json_str(quoted: str) -> str:
    import json

    return json.loads(quoted)
