"""The front-end cases: a mix of client requests through SGLang's HTTP server, what each
client saw, and the oracle that says what it should have seen.

Each request names its case in its prompt ("[case r0-3]", read by the stand-in,
detokrig/sglang_standin.py), so its record is found whatever rid the server gave it, and
picks its reply and ids per step there too. `oracle` is SGLang's detokenizer contract
over the ids the stand-in emitted: the Hugging Face decode in SGLang's prompt context,
with SGLang's trim rules and the flags the client asked for. tests/sglang/test_frontend.py
and `python -m detokbench rust-bench --exactness` run the mix.
"""

from __future__ import annotations

import json
from typing import Any

import requests as http

from .sglang_frontend import Frontend, vocab
from .sglang_standin import REPLIES
from .stop_rules import engine_cut, made_by

# Sampling fields SGLang's OpenAI endpoints take beside the OpenAI ones (the client's extra_body).
OPENAI_EXTRA = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stop_token_ids", "ignore_eos")
ABORT_AFTER = 3  # events a client reads before it asks /abort_request to end its request
FLAGS = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")


def requests_for(name: str, extended: bool = False) -> list[dict]:
    """The mix: endpoint, stream, reply, ids per step, sampling parameters, and the
    case class (`kind`). `extended` adds what only the exactness comparison sends:
    SGLang's own sampling fields on /v1/completions, requests the engine aborts ("[abort
    N]": the stand-in ends them after N ids) while their client listens, and requests
    their client ends through /abort_request by the rid it gave them."""
    stop_id = vocab(name).hf.encode(REPLIES[2], add_special_tokens=False)[6]
    base = [
        dict(kind="completions", api="completions", stream=False, reply=0, params=dict(max_tokens=200)),
        dict(kind="completions stream, max_tokens", api="completions", stream=True, reply=2,
             params=dict(max_tokens=12)),
        dict(kind="stop string inside a ZWJ emoji", api="completions", stream=True, reply=1,
             params=dict(max_tokens=200, stop=["\u200d👩"])),
        dict(kind="stop string of Cyrillic, 3-4 ids a step", api="completions", stream=True, reply=3, step=3,
             params=dict(max_tokens=200, stop=["ещё этих"])),
        dict(kind="completions logprobs", api="completions", stream=False, reply=4, params=dict(max_tokens=20, logprobs=2)),
        dict(kind="chat stream", api="chat", stream=True, reply=0, step=2, params=dict(max_tokens=200)),
        dict(kind="chat, stop string", api="chat", stream=False, reply=3, params=dict(max_tokens=200, stop=[" STOP"])),
        dict(kind="generate stream, specials kept", api="generate", stream=True, reply=1,
             params=dict(max_new_tokens=200, skip_special_tokens=False, spaces_between_special_tokens=False)),
        dict(kind="generate, stop token id", api="generate", stream=False, reply=2,
             params=dict(max_new_tokens=200, stop_token_ids=[stop_id])),
        dict(kind="generate stream, stop string of Han, no_stop_trim", api="generate", stream=True, reply=0,
             params=dict(max_new_tokens=200, stop=["世界"], no_stop_trim=True)),
        # "Hello" holds the stop string twice: the scheduler stops on its first "l".
        dict(kind="generate stream, stop string twice in a token", api="generate", stream=True, reply=0,
             params=dict(max_new_tokens=200, stop=["l"])),
        dict(kind="generate, ignore_eos", api="generate", stream=False, reply=4, step=2,
             params=dict(max_new_tokens=150, ignore_eos=True)),
    ]
    if extended:
        base += [
            dict(kind="completions stream, specials kept", api="completions", stream=True, reply=1,
                 params=dict(max_tokens=200, skip_special_tokens=False, spaces_between_special_tokens=False)),
            dict(kind="completions, stop token id", api="completions", stream=False, reply=2,
                 params=dict(max_tokens=200, stop_token_ids=[stop_id])),
            dict(kind="completions stream, no_stop_trim", api="completions", stream=True, reply=0,
                 params=dict(max_tokens=200, stop=["世界"], no_stop_trim=True)),
            dict(kind="generate stream, engine aborts", api="generate", stream=True, reply=0, abort=6,
                 params=dict(max_new_tokens=200)),
            dict(kind="completions stream, engine aborts", api="completions", stream=True, reply=3, abort=6,
                 params=dict(max_tokens=200)),
            # Long enough that an abort which takes effect always ends them first.
            dict(kind="generate stream, /abort_request by rid", api="generate", stream=True, reply=0, abort_rid=True,
                 params=dict(max_new_tokens=1000, ignore_eos=True)),
            dict(kind="completions stream, /abort_request by rid", api="completions", stream=True, reply=0,
                 abort_rid=True, params=dict(max_tokens=1000, ignore_eos=True)),
        ]
    out = []
    for rep in range(3):
        for i, r in enumerate(base):
            step = r.get("step", 1) + rep % 2
            rid = f"r{rep}-{i}"
            abort = f" [abort {r['abort']}]" if "abort" in r else ""
            out.append({**r, "rid": rid, "prompt": f"Please answer. [reply {r['reply']}] [step {step}]{abort} [case {rid}]"})
    out.append(dict(kind="client hangs up", api="hangup", stream=True, reply=0, rid="hangup",
                    prompt="Talk. [reply 0] [step 1] [case hangup]", params=dict(max_new_tokens=4000, ignore_eos=True)))
    return out


def call(fe: Frontend, r: dict) -> dict:
    """One client's request: its text, finish reason, usage and logprobs as the client
    saw them, and the error it got instead of an answer or in the middle of its stream
    (None when there was none)."""
    try:
        return (_call_openai if r["api"] in ("completions", "chat") else _call_generate)(fe, r)
    except Exception as e:  # what the client saw is the result; the caller compares it
        return dict(text=None, finish=None, usage=None, logprobs=None, error=f"{type(e).__name__}: {e}")


def _call_openai(fe: Frontend, r: dict) -> dict:
    from openai import APIError, OpenAI

    client = OpenAI(base_url=fe.url + "/v1", api_key="none", timeout=300, max_retries=0)
    p = dict(r["params"])
    logprobs = p.pop("logprobs", None)
    extra = {"rid": r["rid"], **{k: p.pop(k) for k in OPENAI_EXTRA if k in p}}
    kw = dict(model="default", stream=r["stream"], temperature=0, extra_body=extra, **p)
    if r["stream"]:
        kw["stream_options"] = {"include_usage": True}
    if r["api"] == "completions":
        resp = client.completions.create(prompt=r["prompt"], logprobs=logprobs, **kw)
    else:
        resp = client.chat.completions.create(messages=[{"role": "user", "content": r["prompt"]}], **kw)
    if not r["stream"]:
        c = resp.choices[0]
        text = c.text if r["api"] == "completions" else c.message.content
        lp = c.logprobs.model_dump() if logprobs and c.logprobs else None
        return dict(text=text, finish=c.finish_reason, usage=resp.usage.model_dump(), logprobs=lp, error=None)
    text, finish, usage, error = "", None, None, None
    try:
        for n, chunk in enumerate(resp, 1):
            if n == ABORT_AFTER and r.get("abort_rid"):
                abort_request(fe, r["rid"])
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
            for c in chunk.choices:
                text += (c.text if r["api"] == "completions" else c.delta.content) or ""
                finish = c.finish_reason or finish
    except APIError as e:  # an error event in the stream
        error = f"{type(e).__name__}: {e}"
    return dict(text=text, finish=finish, usage=usage, logprobs=None, error=error)


def _call_generate(fe: Frontend, r: dict) -> dict:
    body = {"text": r["prompt"], "rid": r["rid"], "stream": r["stream"], "sampling_params": r["params"]}
    resp = http.post(fe.url + "/generate", json=body, stream=r["stream"], timeout=300)
    if not r["stream"]:
        if resp.status_code != 200:
            return dict(text=None, finish=None, usage=None, error=f"HTTP {resp.status_code}: {resp.text[:300]}")
        out = resp.json()
        return dict(text=out["text"], finish=out["meta_info"]["finish_reason"], usage=usage_of(out["meta_info"]),
                    error=None)
    last, lines, error = None, 0, None
    for line in resp.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[len(b"data: "):])
        if "text" not in event:  # an error event
            error = json.dumps(event, ensure_ascii=False)[:300]
            continue
        last = event
        lines += 1
        if lines == ABORT_AFTER and r.get("abort_rid"):
            abort_request(fe, r["rid"])
        if r["api"] == "hangup" and lines == 5:
            resp.close()  # the client goes away mid-stream
            return dict(text=last["text"], finish=None, usage=None, error=None)
    if last is None:
        return dict(text="", finish=None, usage=None, error=error or f"HTTP {resp.status_code}, no event")
    return dict(text=last["text"], finish=last["meta_info"]["finish_reason"], usage=usage_of(last["meta_info"]),
                error=error)


def abort_request(fe: Frontend, rid: str) -> None:
    """SGLang's /abort_request for one rid (the answer is empty either way: the stream tells)."""
    http.post(fe.url + "/abort_request", json={"rid": rid}, timeout=60)


def usage_of(meta: dict) -> dict:
    return {"prompt_tokens": meta["prompt_tokens"], "completion_tokens": meta["completion_tokens"]}


def asked(r: dict) -> dict:
    """The flags the client set itself (SGLang's defaults for the rest)."""
    return {k: r["params"][k] for k in FLAGS if k in r["params"]}


def oracle(name: str, rec: dict, flags: dict | None = None) -> str:
    """The text SGLang's detokenizer contract gives the ids the stand-in emitted, with the
    flags the scheduler got (`rec`) or, where given, the ones the client asked for; a stop
    string cut at the first occurrence that ends past the text of the rows before the
    finishing one (docs/stop-strings.md)."""
    hf = vocab(name).hf
    f = {k: rec[k] for k in FLAGS} | (flags or {})
    ctx, out, finish = rec["context"], list(rec["output_ids"]), rec["finish"]
    matched = finish.get("matched")
    if isinstance(matched, int) and not f["no_stop_trim"]:
        out = out[:-1]
    kw = dict(skip_special_tokens=f["skip_special_tokens"], spaces_between_special_tokens=f["spaces_between_special_tokens"])

    def text_of(ids: list[int]) -> str:
        return hf.decode(ctx + ids, **kw)[len(hf.decode(ctx, **kw)):]

    text = text_of(out)
    if isinstance(matched, str) and matched:
        earlier = made_by(text_of(out[: rec["earlier"]]), text)
        text = text[: engine_cut(text, earlier, matched, f["no_stop_trim"])]
    return text


def finish_type(finish: Any) -> str | None:
    """A finish reason as an OpenAI client names it ("stop", "length", "abort"), from
    either endpoint's form (/generate's is a dict)."""
    if isinstance(finish, dict):
        return finish.get("type")
    return finish


def ignored(r: dict, rec: dict) -> list[str]:
    """The fields the client sent that never reached the scheduler as sent, and its rid
    when /abort_request by that rid did not end the request (a front end may give the
    scheduler a rid of its own: what counts is whether the client's rid reaches it)."""
    p = r["params"]
    out = [k for k in (*FLAGS, "ignore_eos") if k in p and rec.get(k) != p[k]]
    if "stop_token_ids" in p and not set(p["stop_token_ids"]) <= set(rec.get("stop_token_ids", [])):
        out.append("stop_token_ids")
    if "stop" in p and sorted(p["stop"]) != sorted(rec.get("stop", [])):
        out.append("stop")
    if r.get("abort_rid") and rec["finish"]["type"] != "abort":
        out.append("rid")
    return out


def records_by_case(fe: Frontend) -> dict[str, dict]:
    """The stand-in's records of the server's requests, by the case their prompt names."""
    return {r["case"]: r for r in fe.records().values() if r.get("case")}
