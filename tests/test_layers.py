"""The package's shape: which part may import which, read from the code itself.

A part is a top-level module or a folder of detokd. Data flows one way, wire dialect ->
core -> delivery, and each part imports only parts on a lower floor of LAYERS: so no
import runs back up and there is no cycle between folders. The core imports nothing
outside itself but the tokenizer and logs (every module's logger, on the lowest
floor): no sockets, no metrics library, no HTTP server. At run time, one frame's way goes
the same one way: no call goes back into a part the frame has left (utils.crossings).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import msgspec
from utils import crossings, deepseek

import detokd
from detokd.process import ipc_config
from detokd.server import Server
from detokd.wire.native import NativeDialect

PACKAGE = Path(detokd.__file__).parent

# Lowest floor first. A new module gets a floor here; moving one up or down is a design
# change, made here on purpose.
LAYERS = [
    ["zoo", "readiness", "logs"],  # logs: every module's logger (logs.get), so the floor
    ["tokenizer"],
    ["core"],  # table, decoders, stops, request state, the stats record
    ["output"],  # what a frame produced, encoded: between a dialect and delivery
    ["config", "gc_policy"],
    ["http", "sockets", "process"],
    ["metrics", "delivery", "launch"],
    ["wire"],  # the native dialect
    ["conductor"],  # between a dialect and delivery: one frame's way, the stall policy
    ["server", "client"],
    ["sglang", "demo"],  # SGLang's dialect, schema, process and plugin: all of it here
    ["cli"],
    ["__main__"],
]
FLOOR = {part: i for i, parts in enumerate(LAYERS) for part in parts}


def _part(module: str) -> str | None:
    """detokd.core.stops -> core; detokd -> None (the package's face)."""
    names = module.split(".")
    return names[1] if len(names) > 1 and names[0] == "detokd" else None


def _imports(path: Path, packages: tuple[str, ...] = ("detokd",)) -> set[str]:
    """The modules of `packages` a file imports, relative imports resolved."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    package = list(rel.parts[:-1])  # what `.` means here, for a module and an __init__ alike
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".") if node.level else node.module or ""
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.split(".")[0] in packages}


def test_every_part_of_the_package_has_a_floor():
    parts = {p.stem for p in PACKAGE.glob("*.py")} | {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert parts - {"__init__"} == set(FLOOR)


def test_no_import_runs_back_up_a_floor_or_across_one():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = _part("detokd." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
        for target in sorted(_imports(path)):
            there = _part(target)
            if here is None or there is None or there == here or there not in FLOOR:
                continue  # the package's face, a name inside a module, or the part itself
            if FLOOR[there] >= FLOOR[here]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)} imports {target} (floor {FLOOR[there]} >= {FLOOR[here]})")
    assert not wrong, "\n".join(wrong)


def test_the_core_loads_with_no_sockets_metrics_or_http_and_nothing_of_detokd_beyond_the_tokenizer_and_logs():
    # Blocked in sys.modules, an import of zmq or prometheus_client raises: the core must
    # not need them, even indirectly.
    core = sorted(f"detokd.core.{p.stem}" for p in (PACKAGE / "core").glob("*.py") if p.stem != "__init__")
    code = (
        "import sys\n"
        "for name in ('zmq', 'prometheus_client', 'uvloop', 'http.server'): sys.modules[name] = None\n"
        f"for m in {core!r}: __import__(m)\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('detokd'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    loaded = set(out.stdout.split())
    assert set(core) <= loaded
    assert {_part(m) for m in loaded} <= {None, "core", "tokenizer", "zoo", "logs"}, loaded


# The checkout's packages, lowest first: the product, the rig the tests and the tools
# drive it with, the tools. Each imports only those before it (the tests import any).
CHECKOUT = ["detokd", "detokrig", "detokbench"]


def test_the_product_imports_neither_the_rig_nor_the_tools_and_the_rig_not_the_tools():
    wrong = []
    for low, name in enumerate(CHECKOUT):
        above = set(CHECKOUT[low + 1:])
        for path in sorted((PACKAGE.parent / name).rglob("*.py")):
            wrong += [f"{path.relative_to(PACKAGE.parent)} imports {m}" for m in sorted(_imports(path, tuple(above)))]
    assert not wrong, "\n".join(wrong)


def test_each_native_frame_goes_one_way_dialect_then_core_then_delivery(tmp_path):
    """Every kind of frame a scheduler or a peer sends, through the loop's `process`: the
    dialect asks the core, the core returns what the frame produced, the dialect returns
    it encoded, and delivery sends it; a register is delivery's, then the core's."""
    server = Server(ipc_config(tmp_path, metrics_port=0, register_enabled=True, register_allow=[f"ipc://{tmp_path}/*"]),
                    NativeDialect.make, vocab=deepseek())
    enc = msgspec.msgpack.encode
    frames = {
        "start": enc({"type": "tokens", "rows": [{"rid": f"r{i}", "ids": [100, 200 + i], "start": {"stop": ["x"]}} for i in range(3)]}),
        "tokens": enc({"type": "tokens", "rows": [{"rid": f"r{i}", "ids": [300 + i], "seq": 2} for i in range(3)]}),
        "register": enc({"type": "register", "worker": 1, "address": f"ipc://{tmp_path}/w1.sock"}),
        "start on the new worker": enc({"type": "tokens", "rows": [{"rid": "w", "ids": [100], "start": {"worker": 1}}]}),
        "finish": enc({"type": "tokens", "rows": [{"rid": "r0", "ids": [400], "seq": 3, "finish": {"reason": "stop"}}]}),
        "abort": enc({"type": "abort", "rids": ["r1"]}),
    }
    try:
        for what, frame in frames.items():
            calls, wrong = crossings(server.process, frame, False)
            assert wrong == [], what
            assert any(c.endswith("NativeDialect.handle") for c in calls), what
        assert server.core.known(1) and server.delivery.known(1)  # the register took
        assert server.stats.errors == {} and server.stats.bad_frames == 0  # every frame was read as meant
    finally:
        server.close()
