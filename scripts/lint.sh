#!/usr/bin/env bash
# Lint the product, the tools, their rig and the tests; type-check the product (pyproject.toml's [tool.ruff] and [tool.mypy]).
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check detokd detokrig detokbench tests
mypy detokd
