"""`python -m sglang.launch_server ARGS...` with the stand-in scheduler in the model's place.

usage: serve_standin.py ARGS...   (ARGS as after `python -m sglang.launch_server`)

The same steps as sglang/launch_server.py's main on its default (HTTP) path: plugins,
SGLang's own argument parser, resolution, `launch_server`; the only differences are the
scheduler process function and the launch callback, which SGLang calls once its launch
is done, on either of its servers (Python's, after the warmup request; the Rust one's,
once the schedulers are ready): it writes the titles of the detokenizer processes the
launch started to $STANDIN_LAUNCH, as JSON.
"""

import json
import os
import sys

import psutil
from sglang.srt.entrypoints.http_server import launch_server
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import prepare_server_args
from sglang.srt.utils import kill_process_tree

from detokrig.sglang_standin import run_standin_scheduler

LAUNCH_ENV = "STANDIN_LAUNCH"


def record_launch() -> None:
    """Which detokenizer processes SGLang's launch started (their titles)."""
    path = os.environ.get(LAUNCH_ENV)
    if not path:
        return
    titles = []
    for p in psutil.Process().children(recursive=True):
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "sglang::detokenizer" in title:
            titles.append(title)
    with open(path + ".part", "w") as f:
        json.dump({"detokenizers": titles}, f)
    os.replace(path + ".part", path)


if __name__ == "__main__":
    load_plugins()
    server_args = prepare_server_args(sys.argv[1:])
    try:
        server_args.resolve_once()
        launch_server(server_args, run_scheduler_process_func=run_standin_scheduler, launch_callback=record_launch)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
