"""detokd's caps and bounded memory: what no frame, request or peer can make it hold.

Frames over the caps, rows past a frame's budgets, stop automata, a dead worker's queue,
the RSS guard, held text, the feedback queue, every message type's caps and an open
byte-fallback run: each bounded, each refusal said (too_large, overloaded...), the
rows within the caps served exactly. Real `detokd serve` processes, real ZMQ sockets,
texts checked against the oracle (docs/reliability.md, docs/security.md).
"""
from __future__ import annotations

import os
import random

import msgspec
import pytest
import zmq
from conftest import oracle, vocab
from utils import Engine, Req, Sink, logged, make_ids, metric, metrics_port, pull, scrape, wait_until
from zmq.utils.monitor import recv_monitor_message

from detokrig.proc import ProcTree
from detokrig.proc import memory as proc_memory

dec = msgspec.msgpack.decode


# --------------------------------------------------------------------------- 1. memory caps


def test_a_frame_over_max_frame_bytes_is_never_read_and_its_sender_is_cut_off(detokd, zctx):
    d = detokd(workers=1, args=["--metrics-port", "0"], max_frame_bytes=1 << 20, max_meta_bytes=4 << 20)
    w = Sink(zctx, d.workers[0])
    d.wait_ready()
    eng = Engine(zctx, d.input)
    mon = eng.sock.get_monitor_socket()
    mon.setsockopt(zmq.RCVTIMEO, 20000)
    eng.rows([{"rid": "huge", "ids": [100], "start": {}, "meta": "x" * (2 << 20)}])
    while recv_monitor_message(mon)["event"] != zmq.EVENT_DISCONNECTED:
        pass
    eng.sock.disable_monitor()
    mon.close(0)
    r = Req("after", make_ids(random.Random(6), 30))
    eng.rows([r.row(30)])  # PUSH reconnects by itself
    w.wait(lambda: w.ended("after"), 20, "the next request after the cut-off")
    assert w.text("after") == r.expected() and not w.rows("huge")
    assert metric(scrape(metrics_port(d)), "detokd_frames_total") == 1


def test_rows_beyond_the_caps_get_too_large_and_rows_at_the_caps_are_served(detokd, zctx):
    d = detokd(
        workers=1, args=["--metrics-port", "0"], max_rows=4, max_row_ids=16, max_rid_len=32, max_meta_bytes=64,
        max_wire_prompt_tail=8, max_stop_strings=2, max_stop_chars=10,
    )
    w = Sink(zctx, d.workers[0])
    d.wait_ready()
    eng = Engine(zctx, d.input)
    v = vocab("deepseek")
    rng = random.Random(7)
    ids = make_ids(rng, 16)
    tail = make_ids(rng, 8)
    eng.rows([{"rid": f"many{i}", "ids": [100], "start": {}} for i in range(5)])  # 5 rows: a bad frame
    eng.rows([
        {"rid": "ids", "ids": make_ids(rng, 17), "start": {}},
        {"rid": "tail", "ids": [100], "start": {"prompt_tail": make_ids(rng, 9)}},
        {"rid": "nstops", "ids": [100], "start": {"stop": ["qq", "zz", "xx"]}},
    ])
    eng.rows([{"rid": "chars", "ids": [100], "start": {"stop": ["qqqqqq", "zzzzz"]}}, {"rid": "r" * 33, "ids": [1], "start": {}}])
    eng.rows([{"rid": "live", "ids": ids[:2], "start": {}}])
    eng.rows([{"rid": "live", "ids": ids[2:4], "seq": 2, "meta": "m" * 70}])  # meta beyond the cap on a plain row
    eng.rows([{"rid": "live", "ids": [5], "seq": 4}])  # its state is gone: too_large again
    edge = {"rid": "e" * 32, "ids": ids, "start": {"prompt_tail": tail, "stop": ["\x00qq", "\x01zz"]}, "meta": "m" * 60,
            "finish": {"reason": "length"}}
    eng.rows([edge])
    w.wait(lambda: w.ended("e" * 32), 20, "the row at every cap")
    for rid in ("ids", "tail", "nstops", "chars"):
        assert w.errors(rid) == ["too_large"], rid
    assert [r["text"] for r in w.rows("live")][0] == oracle(v, [], ids[:2], True)
    assert w.errors("live") == ["too_large", "too_large"]
    assert not any(w.rows(f"many{i}") for i in range(5)) and not w.rows("r" * 33)
    assert w.text("e" * 32) == oracle(v, tail, ids, True) and not w.errors("e" * 32)
    m = scrape(metrics_port(d))
    assert metric(m, "detokd_bad_frames_total") == 1
    assert metric(m, "detokd_errors_total", kind="too_large") == 7  # 4 starts, the long rid, live twice


def _array(n: int, item: bytes) -> msgspec.Raw:
    """A MessagePack array of n copies of an encoded item, written by hand."""
    return msgspec.Raw(b"\xdd" + n.to_bytes(4, "big") + item * n)


SPACES = 69933  # deepseek's id with the longest text: 128 spaces (5 bytes on the wire, 128 characters out)
ID5 = b"\xce" + SPACES.to_bytes(4, "big")  # as MessagePack writes it: 5 bytes

# Four shapes of a 25 MB frame whose lists detokd must not read: 5 M ids in one row; 5 M
# in 77 rows each within max_row_ids, all past the frame's max_frame_ids; a start's
# prompt_tail of 5 M ids; a start's 5 M stop strings.
OVER_CAPS = {
    "one row over max_row_ids": [{"rid": "big", "ids": _array(5_000_000, ID5), "start": {}}],
    "rows past max_frame_ids": [{"rid": f"past{i}", "ids": _array(65_536, ID5), "start": {}} for i in range(77)],
    "a prompt_tail over max_wire_prompt_tail": [{"rid": "tail", "ids": [100], "start": {"prompt_tail": _array(5_000_000, ID5)}}],
    "stop strings over max_stop_strings": [{"rid": "stops", "ids": [100], "start": {"stop": _array(5_000_000, b"\xa4stop")}}],
}


@pytest.mark.parametrize("shape", list(OVER_CAPS))
def test_lists_over_the_caps_are_refused_unread_and_cost_a_small_multiple_of_their_frame(detokd, zctx, shape):
    # msgspec made every item a Python object (an id 36 bytes for 5 on the wire) before
    # any cap on them was checked: 183-257 MB of peak RSS for one such frame. Their
    # lengths are read from each array's header instead; the rows over a cap get
    # too_large as they did, every other row is served as it was.
    d = detokd(workers=1, args=["--metrics-port", "0"])
    w = Sink(zctx, d.workers[0])
    d.wait_ready()
    eng = Engine(zctx, d.input)
    v = vocab("deepseek")
    rng = random.Random(16)
    honest = {f"h{i}": make_ids(rng, 40) for i in range(3)}
    live = make_ids(rng, 20)
    eng.rows([{"rid": "live", "ids": live[:10], "start": {}}])
    _fence(eng, w, "warm", v)
    over = [{**row, "meta": row["rid"]} for row in OVER_CAPS[shape]]
    frame = msgspec.msgpack.encode({"type": "tokens", "rows": [
        *({"rid": rid, "ids": ids, "start": {}, "finish": {"reason": "length"}} for rid, ids in honest.items()),
        *over,
        {"rid": "live", "ids": live[10:], "seq": 10, "finish": {"reason": "length"}},
    ]})
    assert 25e6 < len(frame) < 26e6
    ProcTree(d.pid).reset_peak()
    before = proc_memory(d.pid)
    assert before.hwm_kb - before.rss_kb < 1024, before  # the peak starts from now
    eng.raw(frame)
    _fence(eng, w, "after", v)
    grown = (proc_memory(d.pid).hwm_kb - before.rss_kb) * 1024
    for rid, ids in honest.items():
        assert w.text(rid) == oracle(v, [], ids, True) and not w.errors(rid), rid
    for row in over:
        assert [(r["error"], r["meta"]) for r in w.rows(row["rid"])] == [("too_large", row["rid"])]
    # A live request's row after ids past the budget gets too_large, as ever; after a
    # start over a cap on its lists, its text.
    past_budget = shape in ("one row over max_row_ids", "rows past max_frame_ids")
    assert w.errors("live") == (["too_large"] if past_budget else [])
    assert w.text("live") == oracle(v, [], live[:10] if past_budget else live, True)
    m = scrape(metrics_port(d))
    assert metric(m, "detokd_errors_total", kind="too_large") == len(over) + past_budget
    assert metric(m, "detokd_bad_frames_total") == 0
    assert grown <= 3 * len(frame), f"peak RSS grew {grown / 1e6:.0f} MB for a frame of {len(frame) / 1e6:.0f} MB"


def test_rows_past_a_frames_id_budget_get_too_large_and_the_rows_before_are_served(detokd, zctx):
    # An id is a byte or more on the wire but its text up to a long token's (deepseek:
    # 128 bytes), so a frame's ids, not only its bytes, bound what it makes detokd write.
    d = detokd(workers=1, args=["--metrics-port", "0"], max_frame_ids=20)
    w = Sink(zctx, d.workers[0])
    d.wait_ready()
    eng = Engine(zctx, d.input)
    v = vocab("deepseek")
    rng = random.Random(11)
    ids = {rid: make_ids(rng, 8) for rid in ("a", "b", "c", "d")}
    eng.rows([{"rid": "d", "ids": ids["d"][:4], "start": {}}])
    eng.rows([
        {"rid": "a", "ids": ids["a"], "start": {}, "finish": {"reason": "length"}},
        {"rid": "b", "ids": ids["b"], "start": {}, "finish": {"reason": "length"}},  # 16 ids: within
        {"rid": "c", "ids": ids["c"], "start": {}},  # 24: past the budget
        {"rid": "d", "ids": ids["d"][4:], "seq": 4},  # a live request past it is failed too
    ])
    w.wait(lambda: w.rows("c") and len(w.rows("d")) == 2, 20, "every row answered")
    assert w.text("a") == oracle(v, [], ids["a"], True) and w.text("b") == oracle(v, [], ids["b"], True)
    assert not w.errors("a") and not w.errors("b")
    assert w.errors("c") == w.errors("d") == ["too_large"]
    eng.rows([{"rid": "d", "ids": [5], "seq": 8}])  # its state is gone
    w.wait(lambda: len(w.rows("d")) == 3, 20, "d's next row")
    assert w.errors("d") == ["too_large", "too_large"]
    assert metric(scrape(metrics_port(d)), "detokd_errors_total", kind="too_large") == 3


def test_starts_past_a_frames_stop_building_budget_get_too_large_and_seen_lists_cost_nothing(detokd, zctx):
    # Building an automaton costs ~1.4 us a stop character: a frame of distinct stop
    # lists could hold the loop for minutes. A list seen before is cached.
    d = detokd(workers=1, args=["--metrics-port", "0"], max_frame_stop_chars=12)
    w = Sink(zctx, d.workers[0])
    d.wait_ready()
    eng = Engine(zctx, d.input)
    v = vocab("deepseek")
    ids = v.backend.encode("one two three four", add_special_tokens=False).ids
    seen, fresh = ["three", "four"], ["xyzzy", "plugh"]  # 9 and 10 characters
    eng.rows([{"rid": "warm", "ids": ids, "start": {"stop": seen}, "finish": {"reason": "length"}}])
    w.wait(lambda: w.ended("warm"), 20, "the first use of a stop list")
    eng.rows([
        {"rid": "new", "ids": ids, "start": {"stop": fresh}, "finish": {"reason": "length"}},  # 10 of 12: built
        {"rid": "over", "ids": ids, "start": {"stop": ["zorkmid"]}, "finish": {"reason": "length"}},  # 17: past
        *({"rid": f"again{i}", "ids": ids, "start": {"stop": seen}, "finish": {"reason": "length"}} for i in range(3)),
    ])
    w.wait(lambda: all(w.ended(r) for r in ("new", "over", "again0", "again1", "again2")), 20, "every row answered")
    assert w.errors("over") == ["too_large"]
    assert w.text("new") == oracle(v, [], ids, True)
    for rid in ("warm", "again0", "again1", "again2"):  # cut before "three", served
        assert w.text(rid) == oracle(v, [], ids, True)[: oracle(v, [], ids, True).index("three")] and not w.errors(rid)
    eng.rows([{"rid": "next", "ids": ids, "start": {"stop": ["zorkmid"]}, "finish": {"reason": "length"}}])
    w.wait(lambda: w.ended("next"), 20, "a start in the next frame")  # the budget is the frame's
    assert w.text("next") == oracle(v, [], ids, True) and not w.errors("next")


def test_stop_automata_alive_are_bounded_in_bytes_and_a_new_list_past_them_is_overloaded(detokd, zctx):
    # Each request may bring a stop list of its own, and holds its automaton while it
    # lives: across frames, max_states of them would be gigabytes.
    d = detokd(workers=1, args=["--metrics-port", "0"], max_stop_bytes=5000)  # one 10-character list (~3.4 KB)
    w = Sink(zctx, d.workers[0])
    d.wait_ready()
    port = metrics_port(d)
    eng = Engine(zctx, d.input)
    v = vocab("deepseek")
    ids = v.backend.encode("one two three four", add_special_tokens=False).ids
    eng.rows([{"rid": "a", "ids": ids[:2], "start": {"stop": ["abcdefghij"]}}])  # lives on
    eng.rows([{"rid": "b", "ids": ids, "start": {"stop": ["klmnopqrst"]}, "finish": {"reason": "length"}}])
    w.wait(lambda: w.rows("a") and w.ended("b"), 20, "a's first row and b's answer")
    assert w.errors("b") == ["overloaded"] and not w.errors("a")
    # Published between batches: it may follow the answer by a turn of the loop.
    alive = wait_until(lambda: metric(scrape(port), "detokd_memory_bytes", memory="stop_automata_alive"), 20, "the gauge")
    assert 0 < alive <= 5000
    eng.rows([{"rid": "a", "ids": ids[2:], "seq": 2, "finish": {"reason": "length"}}])  # a ends: its automaton only cached
    eng.rows([{"rid": "c", "ids": ids, "start": {"stop": ["klmnopqrst"]}, "finish": {"reason": "length"}}])
    w.wait(lambda: w.ended("a") and w.ended("c"), 20, "a's end and c's answer")
    assert w.text("a") == w.text("c") == oracle(v, [], ids, True) and not w.errors("c")  # a's cached automaton made room
    assert metric(scrape(port), "detokd_errors_total", kind="overloaded") == 1


def test_a_dead_workers_queue_is_bounded_in_bytes_not_in_messages(detokd, zctx):
    # Worker 0 never binds: every answer for it stays in detokd, 100 MiB of them. Its
    # queue is 4 messages in ZMQ and an 8 MiB backlog; beyond, answers are lost and
    # their requests fail, while worker 1 is served exactly.
    d = detokd(workers=2, args=["--metrics-port", "0"], send_hwm=4, send_queue_bytes=8 << 20)
    w1 = Sink(zctx, d.workers[1])
    d.wait_ready()
    port = metrics_port(d)
    eng = Engine(zctx, d.input)
    ids = make_ids(random.Random(12), 30)
    eng.rows([{"rid": "warm", "ids": ids, "start": {"worker": 1}, "finish": {"reason": "length"}}])
    w1.wait(lambda: w1.ended("warm"), 20, "the warm-up request")
    base = _rss_mb(d.pid)
    meta = b"\0" * (512 << 10)
    for i in range(200):
        eng.rows([{"rid": f"d{i}", "ids": [100], "start": {"worker": 0}, "meta": meta}])
    eng.rows([{"rid": "ok", "ids": ids, "start": {"worker": 1}, "finish": {"reason": "length"}}])
    w1.wait(lambda: w1.ended("ok"), 20, "worker 1's request behind them")
    assert w1.text("ok") == oracle(vocab("deepseek"), [], ids, True)
    # The loop publishes per-worker figures at the end of its turn, a moment after "ok" left.
    dropped = lambda m: metric(m, "detokd_worker_dropped_total", worker="0")  # noqa: E731
    m = wait_until(lambda: (lambda m: dropped(m) >= 200 - 4 - 16 and m)(scrape(port)), 10, "the turn's figures")
    held = metric(m, "detokd_worker_backlog_bytes", worker="0")
    assert (8 << 20) - len(meta) - 1024 < held <= 8 << 20  # full, and no more
    assert metric(m, "detokd_errors_total", kind="worker_stalled") == metric(m, "detokd_worker_dropped_total", worker="0")
    assert _rss_mb(d.pid) - base < 48  # ~12 MiB held; the old queue of 10,000 messages held all 100 MiB


# --------------------------------------------------------------------------- 2. RSS guard


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_above_max_rss_new_requests_are_refused_and_live_ones_go_on(detokd, zctx, tmp_path):
    probe = detokd(workers=2)
    probe.wait_ready()
    base = _rss_mb(probe.pid)
    probe.kill()
    chunk = 40 << 20  # above glibc's largest mmap threshold: freed memory goes back to the system
    d = detokd(workers=2, args=["--metrics-port", "0"], max_rss_mb=int(base) + 80, max_meta_bytes=64 << 20)
    stuck = pull(zctx, d.workers[0], hwm=1, rcvbuf=4096)
    w1 = Sink(zctx, d.workers[1])
    d.wait_ready()
    port = metrics_port(d)
    v = vocab("deepseek")
    eng = Engine(zctx, d.input)
    ids = make_ids(random.Random(8), 40)
    eng.rows([{"rid": "live", "ids": ids[:20], "start": {"worker": 1}}])
    w1.wait(lambda: w1.rows("live"), 20, "the live request's first row")
    # Output that worker 0 does not read stays queued in detokd: its RSS grows. The rows
    # belong to a live request, so none of them is refused once the guard is on.
    eng.rows([{"rid": "hog", "ids": [100], "start": {"worker": 0}}])
    for i in range(5):
        eng.rows([{"rid": "hog", "ids": [100], "seq": 1 + i, "meta": b"\0" * chunk}])
    wait_until(lambda: metric(scrape(port), "detokd_frames_total") == 7, 60, "detokd to take every frame")
    wait_until(lambda: metric(scrape(port), "detokd_overloaded") == 1, 60, "the RSS guard to turn on")
    eng.rows([{"rid": "new1", "ids": ids[:5], "start": {"worker": 1}}, {"rid": "live", "ids": ids[20:], "seq": 20, "finish": {"reason": "length"}}])
    w1.wait(lambda: w1.ended("new1") and w1.ended("live"), 20, "the rows sent while overloaded")
    assert w1.errors("new1") == ["overloaded"]
    assert w1.text("live") == oracle(v, [], ids, True) and not w1.errors("live")
    # Worker 0 reads its queue: the memory goes, new requests are served again.
    stuck.setsockopt(zmq.RCVTIMEO, 20000)
    for _ in range(6):
        assert [r["error"] for r in dec(stuck.recv())["rows"]] == [None]
    wait_until(lambda: metric(scrape(port), "detokd_overloaded") == 0, 60, "the RSS guard to turn off")
    eng.rows([{"rid": "new2", "ids": ids, "start": {"worker": 1}, "finish": {"reason": "length"}}])
    w1.wait(lambda: w1.ended("new2"), 20, "a new request after the guard turned off")
    assert w1.text("new2") == oracle(v, [], ids, True)
    m = scrape(port)
    assert metric(m, "detokd_errors_total", kind="overloaded") == 1
    # RSS may cross the limit more than once while the frames come in: each crossing
    # is one transition and one log line.
    turns = metric(m, "detokd_overload_transitions_total")
    log = d.log()
    assert turns >= 2 and log.count("is above max_rss_mb") == log.count("is below max_rss_mb") == turns / 2


# --------------------------------------------------------------------------- 3. memory that grows across frames


def _fence(eng: Engine, w: Sink, rid: str, v) -> None:
    """A request sent last and answered: every frame before it was handled."""
    ids = make_ids(random.Random(rid), 20)
    eng.rows([{"rid": rid, "ids": ids, "start": {}, "finish": {"reason": "length"}}])
    w.wait(lambda: w.ended(rid), 60, f"the fence {rid}")
    assert w.text(rid) == oracle(v, [], ids, True)


def test_a_stream_false_requests_held_text_is_capped_and_freed(detokd, zctx):
    # stream=false keeps every row's text for the finishing row. Each row here is within
    # every cap (65,536 ids in 328 KB, 8 MiB of text), and the text was held across
    # frames without a bound: 30 of them held ~250 MB.
    d = detokd(workers=1, args=["--metrics-port", "0"])
    w = Sink(zctx, d.workers[0])
    d.wait_ready()
    eng = Engine(zctx, d.input)
    v = vocab("deepseek")
    assert v.decode([SPACES], True) == " " * 128
    small = make_ids(random.Random(13), 200)  # a stream=false request within the cap
    eng.rows([{"rid": "small", "ids": small[:100], "start": {"stream": False}}])
    eng.rows([{"rid": "small", "ids": small[100:], "seq": 100, "finish": {"reason": "length"}}])
    _fence(eng, w, "warm", v)
    base = _rss_mb(d.pid)
    row = [SPACES] * 65536
    eng.rows([{"rid": "big", "ids": row, "start": {"stream": False}}])
    for k in range(1, 30):
        eng.rows([{"rid": "big", "ids": row, "seq": k * len(row)}])
    _fence(eng, w, "fence", v)
    grown = _rss_mb(d.pid) - base
    assert [r["text"] for r in w.rows("small")] == ["", oracle(v, [], small, True)]
    assert w.rows("big")[0]["text"] == "" and not w.rows("big")[0]["error"]  # 8 MiB held
    assert w.errors("big") == ["too_large"] * 29  # 16 MiB and more > max_held_text_bytes; then its tombstone
    assert grown < 64, grown  # one row's text at a time; 28 MB measured; without the cap, 251 MB
    assert metric(scrape(metrics_port(d)), "detokd_errors_total", kind="too_large") == 29


def test_above_max_rss_a_live_request_whose_held_text_grows_is_failed(detokd, zctx):
    # 64 stream=false requests, each within max_held_text_bytes, grow by 8 MB a frame
    # together; the RSS guard only refused new requests, so they grew RSS by 223 MB, the
    # limit being 64 MB up. Now the rows that grow held text past the limit fail their
    # request (12 MB grown at the end); a streaming request beside them goes on exactly.
    probe = detokd(workers=1)
    probe.wait_ready()
    base = _rss_mb(probe.pid)
    probe.kill()
    d = detokd(workers=1, args=["--metrics-port", "0"], max_rss_mb=int(base) + 64)
    w = Sink(zctx, d.workers[0])
    d.wait_ready()
    port = metrics_port(d)
    eng = Engine(zctx, d.input)
    v = vocab("deepseek")
    held = [f"h{i}" for i in range(64)]
    streamed = make_ids(random.Random(14), 30 * 4)
    row = [SPACES] * 1000  # 128,000 characters; 30 rows: 3.84 MB, within max_held_text_bytes
    for k in range(30):
        rows = [{"rid": rid, "ids": row, "seq": k * len(row), **({"start": {"stream": False}} if k == 0 else {})} for rid in held]
        s = {"rid": "s", "ids": streamed[4 * k : 4 * k + 4], "seq": 4 * k, **({"start": {}} if k == 0 else {})}
        eng.rows(rows + [{**s, **({"finish": {"reason": "length"}} if k == 29 else {})}])
    w.wait(lambda: w.ended("s"), 60, "the streaming request to finish")
    assert w.text("s") == oracle(v, [], streamed, True) and not w.errors("s")
    for rid in held:
        assert w.errors(rid)[:1] == ["overloaded"], (rid, w.errors(rid))
    assert _rss_mb(d.pid) - base < 64 + 64  # the limit, and what came in before the guard read RSS again
    m = scrape(port)
    # Their text freed, RSS may fall below the limit again: the guard turned on at least once.
    assert metric(m, "detokd_overload_transitions_total") >= 1 and metric(m, "detokd_errors_total", kind="too_large") == 0


def test_the_feedback_queue_is_bounded_in_bytes_and_its_drops_are_counted(detokd, zctx):
    # The scheduler binds its feedback address and does not read `stopped` (4,000 rows of
    # 1,000-character rids a message, 4 MB; 120 MB in all). The feedback socket queues
    # as a worker's does: send_hwm messages and a backlog of send_queue_bytes, the rest
    # lost and counted.
    d = detokd(workers=1, feedback=True, args=["--metrics-port", "0"], send_hwm=4, send_queue_bytes=8 << 20)
    w = Sink(zctx, d.workers[0])
    scheduler = pull(zctx, d.feedback, hwm=1, rcvbuf=4096)
    d.wait_ready()
    port = metrics_port(d)
    eng = Engine(zctx, d.input)
    v = vocab("deepseek")
    ids = v.backend.encode("Hello world, again", add_special_tokens=False).ids
    _fence(eng, w, "warm", v)
    base = _rss_mb(d.pid)
    frames, per = 30, 4000
    for f in range(frames):
        eng.rows([{"rid": f"{f:02d}-{i:04d}-" + "x" * 990, "ids": ids, "start": {"stop": ["world"]}, "finish": {"reason": "length"}}
                  for i in range(per)])
        # One frame in flight: what detokd's input queue holds is not what is measured.
        _fence(eng, w, f"fence-{f}", v)
    grown = _rss_mb(d.pid) - base
    first = f"00-0000-{'x' * 990}"
    assert w.text(first) == oracle(v, [], ids, True).split("world")[0] and w.rows(first)[-1]["finish"]["matched"] == "world"
    m = scrape(port)
    dropped = metric(m, "detokd_feedback_dropped_total")
    assert dropped > 0 and dropped % per == 0
    assert (8 << 20) - (5 << 20) < metric(m, "detokd_feedback_backlog_bytes") <= 8 << 20  # full: one more message would not fit
    assert grown < 80, grown  # ~40 MB measured (ZMQ's 4, the backlog, buffers, the allocator); 1,000 messages held 175 MB
    logged(d, "feedback queue full")
    # The scheduler reads: what was queued arrives, and with what was lost it is every row.
    scheduler.setsockopt(zmq.RCVTIMEO, 20000)
    got = 0
    while got + dropped < frames * per:
        msg = dec(scheduler.recv())
        assert msg["type"] == "stopped" and all(r["matched"] == "world" for r in msg["rows"])
        got += len(msg["rows"])
    assert got + dropped == frames * per


# --------------------------------------------------------------------------- 4. every message type's caps


def test_abort_and_embeddings_messages_have_the_caps_of_a_tokens_message(detokd, zctx):
    # An abort of 60 M rids (57 MiB) held the loop 12.8 s; neither abort nor embeddings
    # had a cap on rows, rid length or meta. Now: more than max_rows rows or rids, the
    # message is a bad frame (refused from its length header, before it is read); a rid
    # beyond max_rid_len gets no row; meta beyond max_meta_bytes gets too_large.
    d = detokd(workers=1, args=["--metrics-port", "0"], max_rows=4, max_rid_len=32, max_meta_bytes=64)
    w = Sink(zctx, d.workers[0])
    d.wait_ready()
    eng = Engine(zctx, d.input)
    v = vocab("deepseek")
    ids = make_ids(random.Random(15), 12)
    eng.rows([{"rid": "live", "ids": ids[:4], "start": {}}])
    eng.send({"type": "abort", "rids": ["live", "a", "b", "c", "d"]})  # 5 rids: dropped whole, live goes on
    eng.send({"type": "abort", "rids": ["r" * 33]})  # names no request: counted
    eng.send({"type": "embeddings", "rows": [{"rid": f"many{i}", "data": [i]} for i in range(5)]})  # a bad frame
    eng.send({"type": "embeddings", "rows": [
        {"rid": "e" * 33, "data": [1]},  # no row at all
        {"rid": "fat", "data": [2], "meta": "m" * 70},  # too_large, not forwarded
        {"rid": "e" * 32, "data": [3], "meta": "m" * 60},  # at every cap: forwarded
    ]})
    eng.rows([{"rid": "live", "ids": ids[4:], "seq": 4, "finish": {"reason": "length"}}])
    w.wait(lambda: w.ended("live") and w.ended("fat"), 20, "live's end and fat's error")
    assert w.text("live") == oracle(v, [], ids, True) and not w.errors("live")
    assert w.errors("fat") == ["too_large"] and not w.embedded.get("fat")
    assert [r["data"] for r in w.embedded["e" * 32]] == [[3]]
    assert not any(w.embedded.get(rid) or w.rows(rid) for rid in ("e" * 33, *(f"many{i}" for i in range(5))))
    m = scrape(metrics_port(d))
    assert metric(m, "detokd_bad_frames_total") == 2
    assert metric(m, "detokd_errors_total", kind="too_large") == 3  # the long rids of the abort and the embedding, fat
    assert metric(m, "detokd_aborts_total") == 0


# --------------------------------------------------------------------------- 5. an open byte-fallback run


@pytest.mark.parametrize("codec", ["window", "auto"])
def test_an_open_byte_run_is_served_exactly_in_one_id_rows_and_bounded(detokd, zctx, codec):
    # mistral_v3 renders a run of <0xXX> pieces all or nothing, so detokd holds it until
    # it ends. The window codec decoded the whole run again each row (a frame of 6,000
    # one-id rows held the loop ~10 s: measured by `python -m detokbench worst-frames`, not here); and
    # a run that never ends was held without a bound. Now one-id rows are exact, and a
    # run past 64 Ki pieces fails its request with too_large.
    d = detokd(workers=1, tokenizer="mistral_v3", codec=codec, args=["--metrics-port", "0"])
    w = Sink(zctx, d.workers[0])
    d.wait_ready()
    eng = Engine(zctx, d.input)
    v = vocab("mistral_v3")
    piece = {t: i for i, t in enumerate(v.tokens) if t}
    han = [piece[f"<0x{b:02X}>"] for b in "中".encode()]
    word = v.backend.encode("and then", add_special_tokens=False).ids
    run = han * 2000
    eng.rows([{"rid": "exact", "ids": [i], "seq": k, **({"start": {}} if k == 0 else {})} for k, i in enumerate(run)])
    eng.rows([{"rid": "exact", "ids": word, "seq": len(run), "finish": {"reason": "length"}}])
    eng.rows([{"rid": "long", "ids": han * 21845, "start": {}}])  # 65,535 pieces: held
    eng.rows([{"rid": "long", "ids": han, "seq": 65535 + 3 * k} for k in range(16)])  # past the bound
    w.wait(lambda: w.ended("exact") and w.ended("long"), 120, "both requests' ends")
    assert w.text("exact") == oracle(v, [], run + word, True) and not w.errors("exact")
    assert "".join(r["text"] for r in w.rows("exact")[:-1]) == ""  # nothing of the open run went early
    rows = w.rows("long")
    assert rows[0]["text"] == "" and rows[0]["error"] is None
    assert w.errors("long") and set(w.errors("long")) == {"too_large"}  # from the row past it on
    logged(d, "beyond the cap on open byte run")
