"""`python -m sglang.launch_server ARGS...` with the stand-in scheduler in the model's place.

usage: serve_standin.py ARGS...   (ARGS as after `python -m sglang.launch_server`)

The same steps as sglang/launch_server.py's main on its default (HTTP) path: plugins,
SGLang's own argument parser, resolution, `launch_server`; the only difference is the
scheduler process function.
"""

import os
import sys

from sglang.srt.entrypoints.http_server import launch_server
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import prepare_server_args
from sglang.srt.utils import kill_process_tree

from detokrig.sglang_standin import run_standin_scheduler

if __name__ == "__main__":
    load_plugins()
    server_args = prepare_server_args(sys.argv[1:])
    try:
        server_args.resolve_once()
        launch_server(server_args, run_scheduler_process_func=run_standin_scheduler)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
