#!/usr/bin/env bash
# Makes sglang importable on a CPU-only machine, for detokd's SGLang tests and benchmarks:
# its DetokenizerManager, io_struct, plugin loader and Engine launch code import and run;
# nothing needs a GPU or model weights.
#   bash scripts/install-sglang.sh                 # into the current python's environment
#   PYTHON=/path/to/venv/bin/python bash scripts/install-sglang.sh
# sglang itself goes in with --no-deps (its CUDA kernels cannot install here), then only the
# modules the detokenizer's import chain needs, pinned to versions that work together
# (scripts/sglang-constraints.txt). pip's noise goes to $LOG, shown only on failure.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
LOG="${LOG:-$(mktemp -t sglang-install-XXXX.log)}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
q() { "$@" >>"$LOG" 2>&1 || { tail -40 "$LOG"; echo "FAILED: $*" >&2; exit 1; }; }

if "$PY" -c "import sglang, sys; sys.exit(sglang.__version__ != '$SGLANG_VERSION')" 2>/dev/null; then
  echo "sglang $SGLANG_VERSION already importable"; exit 0
fi
# The CPU build of torch 2.13.0 lies on this kind of machine's disk; pinning it with -c keeps
# every later install from pulling a CUDA build.
PIN="$(mktemp -t torch-pin-XXXX.txt)"; echo "torch==2.13.0" > "$PIN"
q "$PY" -m pip install -q torch==2.13.0
"$PY" -c "import torch,sys; v=torch.__version__; sys.exit(0 if v.endswith('+cpu') else 'expected the +cpu torch build, got '+v)"
q "$PY" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
q "$PY" -m pip install -q -c "$PIN" -c "$HERE/sglang-constraints.txt" \
  tokenizers==0.23.2 transformers==5.19.0 pyzmq==27.3.0 \
  orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2 triton==3.9.0 \
  pillow==13.0.0 starlette==1.10.0 msgspec==0.23.0 ipython==9.18.1 aiohttp==3.14.5 \
  setproctitle==1.3.8 dill==0.4.1 apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 \
  compressed-tensors==0.18.0 gguf==0.19.0 openai==2.8.0 partial-json-parser==0.2.1.1.post7 \
  fastapi==0.165.0 uvloop==0.23.0 uvicorn==0.54.0 einops==0.8.2 xgrammar==0.2.7

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
print('sglang', sglang.__version__, 'importable: DetokenizerManager, Engine, plugins')"
