#!/usr/bin/env bash
# Every check CI runs, in the order that takes least time on two cores: the SGLang
# environments (one virtualenv per release of the window, scripts/test-sglang.sh) are built
# in the background while the main suite runs (pip waits mostly on the disk and the
# network), then the SGLang suite runs on each. Run from a checkout with detokd and its
# test extra installed (README.md's second line). Each step's time goes to stderr.
#   bash scripts/test.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
begin=$SECONDS
step() { echo "== $1: $((SECONDS - begin)) s since the start" >&2; }

prepare_log="$(mktemp -t sglang-prepare-XXXX.log)"
bash scripts/test-sglang.sh --prepare >"$prepare_log" 2>&1 &
prepare=$!

failed=()
step "lint and types"
bash scripts/lint.sh || failed+=(lint)
step "main suite"
# Two pytest processes, a file each at a time (module fixtures stay whole): one keeps one
# core busy (740 s of CPU in 807 s alone), two finish in 472 s on two cores.
python -m pytest -q -n 2 --dist loadfile --durations=15 || failed+=("main suite")
step "waiting for SGLang's environments"
if ! wait "$prepare"; then
  tail -60 "$prepare_log" >&2; echo "FAILED: building SGLang's environments" >&2; exit 1
fi
grep '^==' "$prepare_log" >&2 || true
step "SGLang suite"
DETOKD_SGLANG_PREPARED=1 bash scripts/test-sglang.sh || failed+=("SGLang suite")
step "done"
if [ ${#failed[@]} -gt 0 ]; then printf 'FAILED: %s\n' "${failed[@]}" >&2; exit 1; fi
