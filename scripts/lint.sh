#!/usr/bin/env bash
# Lint the product, the tools and the tests; type-check the product (pyproject.toml's [tool.ruff] and [tool.mypy]).
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check detokd detokbench tests
mypy detokd
