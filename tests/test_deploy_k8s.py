"""docs/deploy.md's Kubernetes recipe, as far as one machine can play a pod.

A pod's emptyDir is a folder created 0777 without the sticky bit; with the pod's
fsGroup every container also has that group. The recipe's init step makes the folder
2770 (group only, setgid so sockets inherit the group), and each container runs under
`umask 007` so the sockets it binds are group-writable. Here, as root: the same
folder modes, detokd and an engine as two different uids sharing one extra group (set
by os.setgroups/setgid/setuid inside each subprocess, after its imports: this
machine's Python lives under /root, which other uids cannot read), and a third uid
outside the group.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from utils import corpus_ids, expected_text, wait_until

from detokd import zoo

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not sys.platform.startswith("linux"), reason="needs root to play two uids")

DETOKD_UID, ENGINE_UID, STRANGER_UID, POD_GROUP = 41001, 41002, 41003, 42000
REPO = Path(__file__).resolve().parents[1]

# Imports first (as root), then the container's identity and umask, then detokd's own
# command line: what `sh -c 'umask 007 && exec detokd "$@"'` runs as the detokd user.
AS_DETOKD = """
import os, sys
sys.path.insert(0, {repo!r})
import detokd.cli, detokd.server, detokd.wire.native, detokd.metrics, detokd.tokenizer
detokd.tokenizer.load({tokenizer!r})  # every module the tokenizer's load needs
os.setgroups([{group}]); os.setgid({uid}); os.setuid({uid})
os.umask({umask})
sys.exit(detokd.cli.main(["serve", "--tokenizer", {tokenizer!r}, "--input", {input!r}, "--worker", {worker!r}]))
"""

# The engine: binds its worker socket, sends one request, prints the text it gets.
AS_ENGINE = """
import os, sys
import msgspec, zmq
ids = {ids!r}
os.setgroups([{group}]); os.setgid({uid}); os.setuid({uid})
os.umask({umask})
ctx = zmq.Context()
w = ctx.socket(zmq.PULL); w.bind({worker!r})
print("bound", flush=True)
p = ctx.socket(zmq.PUSH); p.connect({input!r})
p.send(msgspec.msgpack.encode({{"type": "tokens", "rows": [
    {{"rid": "k8s", "ids": ids, "seq": 0, "start": {{"worker": 0}}, "finish": {{"reason": "length"}}}}]}}))
text = ""
while True:
    row = msgspec.msgpack.decode(w.recv())["rows"][0]
    text += row["text"]
    if row["finish"] is not None or row["error"] is not None:
        break
print(repr(text), row["error"], flush=True)
"""


@pytest.fixture
def pod():
    """A folder readable by every uid, holding `run` made as an emptyDir is (0777, no
    sticky bit) and a copy of the tokenizer (the zoo cache may be private to root)."""
    base = Path(tempfile.mkdtemp(prefix="detokd-pod-"))
    os.chmod(base, 0o755)
    run = base / "run"
    run.mkdir()
    os.chmod(run, 0o777)
    tok = base / "deepseek"
    shutil.copytree(zoo.build("deepseek"), tok)
    for p in [tok, *tok.iterdir()]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    yield base, run, str(tok)
    shutil.rmtree(base, ignore_errors=True)


def start_detokd(run: Path, tok: str, log: Path, umask: int = 0o007) -> subprocess.Popen:
    code = AS_DETOKD.format(repo=str(REPO), tokenizer=tok, group=POD_GROUP, uid=DETOKD_UID, umask=umask,
                            input=f"ipc://{run}/in.0", worker=f"ipc://{run}/worker-0.sock")
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_an_emptydir_as_created_is_refused(pod):
    """The recipe before its init step: detokd exits 2 naming the folder."""
    base, run, tok = pod
    proc = start_detokd(run, tok, base / "detokd.log")
    assert proc.wait(60) == 2
    assert "writable by every user and not sticky" in (base / "detokd.log").read_text()


def test_after_the_init_step_two_uids_in_the_pod_group_talk_and_a_stranger_cannot(pod):
    base, run, tok = pod
    os.chown(run, 0, POD_GROUP)  # fsGroup's doing
    os.chmod(run, 0o2770)  # the init step: `chmod 2770 /run/detokd`
    log = base / "detokd.log"
    detokd = start_detokd(run, tok, log)
    try:
        wait_until(lambda: "serving:" in log.read_text() or detokd.poll() is not None, 60, "detokd serving")
        assert detokd.poll() is None, log.read_text()
        inp = run / "in.0"
        st = os.stat(inp)
        assert (st.st_uid, st.st_gid) == (DETOKD_UID, POD_GROUP)  # the setgid folder gave it the pod's group
        assert stat.S_IMODE(st.st_mode) & 0o060 == 0o060 and not stat.S_IMODE(st.st_mode) & 0o007
        ids = list(corpus_ids()[1][:40])
        engine = subprocess.run(
            [sys.executable, "-c", AS_ENGINE.format(ids=ids, group=POD_GROUP, uid=ENGINE_UID, umask=0o007,
                                                     worker=f"ipc://{run}/worker-0.sock", input=f"ipc://{inp}")],
            capture_output=True, text=True, timeout=60,
        )
        assert engine.returncode == 0, engine.stderr
        assert engine.stdout.splitlines()[-1] == f"{expected_text(ids)!r} None"
        # A uid outside the pod's group cannot reach the socket.
        stranger = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(f"""
                import os, socket
                os.setgroups([]); os.setgid({STRANGER_UID}); os.setuid({STRANGER_UID})
                try:
                    socket.socket(socket.AF_UNIX).connect({str(inp)!r})
                    print("connected")
                except PermissionError:
                    print("refused")
            """)], capture_output=True, text=True, timeout=30,
        )
        assert stranger.stdout.strip() == "refused", stranger.stdout + stranger.stderr
    finally:
        detokd.terminate()
        assert detokd.wait(30) == 0, log.read_text()
