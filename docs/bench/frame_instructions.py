"""Instructions detokd executes per one-row native frame, counted by valgrind's callgrind.
The count still moves with wall time (the same tree read 64-84k across runs: the loop's
work per second lands on more frames when valgrind runs slower), so compare trees run at
once, one on each core, and read the difference within a pair.

One request, one id a row, one row a frame, in lockstep (a frame goes out when the previous
one's text came back): the B 1 one-id frame of `detokbench bench`. Each tree's `detokd
serve` runs under callgrind; its counters are zeroed after 50 frames and dumped after
`--frames` more, so the figure holds those frames alone (every thread of the process, user
space only: the kernel's side of each send and receive is not in it).

    python docs/bench/frame_instructions.py TREE [TREE ...] [--frames 2000]

TREE: a checkout (`git worktree add --detach /tmp/t 78d12ea`); the client is this one's.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile

import zmq

from detokd.client import SchedulerClient

IDS = [25, 4521, 270, 1151, 5867, 13, 1111, 1048, 3467, 10215, 548, 260, 2503]  # DeepSeek's, plain text
WARM = 50


def count(tree: str, frames: int) -> int:
    with tempfile.TemporaryDirectory() as d:
        inp, out = f"ipc://{d}/in.sock", f"ipc://{d}/w0.sock"
        # The two addresses alone, not this checkout's ipc_config: an older tree's config
        # refuses the keys it does not know.
        with open(f"{d}/c.toml", "w") as f:
            f.write(f'input = "{inp}"\nworkers = ["{out}"]\n')
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVTIMEO, 600_000)  # a tree that cannot start raises zmq.Again, not a hang
        pull.bind(out)
        proc = subprocess.Popen(
            ["env", f"PYTHONPATH={tree}", "PYTHONHASHSEED=0", "valgrind", "--tool=callgrind",
             f"--callgrind-out-file={d}/cg.out", "python", "-P", "-m", "detokd", "serve", "--config", f"{d}/c.toml"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = SchedulerClient(inp, context=ctx)
        try:
            for i in range(WARM + frames):
                if i == WARM:
                    subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
                client.add("r", [IDS[i % len(IDS)]])
                client.flush()
                pull.recv()
            subprocess.run(["callgrind_control", "-d", "frames", str(proc.pid)], check=True, capture_output=True)
            with open(f"{d}/cg.out.1") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("summary:"))
        finally:
            client.close(linger=0)
            proc.terminate()
            proc.wait(600)
            pull.close(0)
            ctx.term()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+")
    ap.add_argument("--frames", type=int, default=2000)
    ns = ap.parse_args()
    for tree in ns.trees:
        rev = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
        print(f"{rev.strip() or tree}\t{count(tree, ns.frames) / ns.frames:,.0f} instructions a frame", flush=True)


if __name__ == "__main__":
    main()
