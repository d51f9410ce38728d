#!/usr/bin/env bash
# Makes one SGLang release importable on a CPU-only machine, for detokd's SGLang tests and
# benchmarks: its DetokenizerManager, io_struct, plugin loader, Engine launch code and HTTP
# front end import and run; nothing needs a GPU or model weights.
#   bash scripts/install-sglang.sh [RELEASE]       # default 0.5.23; into the current python
#   PYTHON=/path/to/venv/bin/python bash scripts/install-sglang.sh 0.5.20
# sglang itself goes in with --no-deps (its CUDA kernels cannot install here), then only the
# modules its import chain needs, held to the versions that worked with that release
# (scripts/sglang-constraints/RELEASE.txt: a pip freeze of a working environment; the
# releases differ in transformers, tokenizers, xgrammar and openai, following SGLang's own
# pins). pip's cache is shared, so a second release reuses the first one's downloads.
# pip's noise goes to $LOG, shown only on failure.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python}"
SGLANG_VERSION="${1:-${SGLANG_VERSION:-0.5.23}}"
PINS="$HERE/sglang-constraints/$SGLANG_VERSION.txt"
LOG="${LOG:-$(mktemp -t sglang-install-XXXX.log)}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
q() { "$@" >>"$LOG" 2>&1 || { tail -40 "$LOG"; echo "FAILED: $*" >&2; exit 1; }; }

if [ ! -f "$PINS" ]; then
  echo "no pins for sglang $SGLANG_VERSION: add scripts/sglang-constraints/$SGLANG_VERSION.txt" >&2; exit 2
fi
if "$PY" -c "import sglang, sys; sys.exit(sglang.__version__ != '$SGLANG_VERSION')" 2>/dev/null; then
  echo "sglang $SGLANG_VERSION already importable"; exit 0
fi
# The CPU build of torch 2.13.0 lies on this kind of machine's disk; pinning it with -c keeps
# every later install from pulling a CUDA build (2.13.0 runs every release here, though
# 0.5.22+ ask for 2.14.1: nothing the tests import needs the newer one).
PIN="$(mktemp -t torch-pin-XXXX.txt)"; echo "torch==2.13.0" > "$PIN"
q "$PY" -m pip install -q torch==2.13.0
"$PY" -c "import torch,sys; v=torch.__version__; sys.exit(0 if v.endswith('+cpu') else 'expected the +cpu torch build, got '+v)"
q "$PY" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
q "$PY" -m pip install -q -c "$PIN" -c "$PINS" \
  tokenizers transformers pyzmq orjson psutil pybase64 requests triton \
  pillow starlette msgspec ipython aiohttp setproctitle dill apache-tvm-ffi sentencepiece \
  compressed-tensors gguf openai partial-json-parser fastapi uvloop uvicorn einops xgrammar

# sglang.srt.multimodal.internvl_utils imports torchvision unconditionally. PyPI's
# torchvision 0.28.0 is a CUDA build whose ops cannot load beside CPU torch, and its
# _meta_registrations then registers fakes for ops that do not exist: guard those
# decorators with torchvision.extension._has_ops(), as the file does for its other ops.
# Nothing in the detokenizer uses torchvision.
q "$PY" -m pip install -q --no-deps torchvision==0.28.0
TVF="$("$PY" -c 'import importlib.util,os; print(os.path.join(os.path.dirname(importlib.util.find_spec("torchvision").origin), "_meta_registrations.py"))')"
sed -i -E 's/^@torch\.library\.register_fake\(("torchvision::[a-z_]+")\)$/@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda f: f))/' "$TVF"
grep -q '_has_ops() else (lambda f: f))' "$TVF"

"$PY" -W ignore -c "
import sglang, sglang.srt.managers.detokenizer_manager, sglang.srt.entrypoints.engine, sglang.srt.plugins
assert sglang.__version__ == '$SGLANG_VERSION', sglang.__version__
print('sglang', sglang.__version__, 'importable: DetokenizerManager, Engine, plugins')"
