#!/usr/bin/env bash
# Lint and type-check the product (pyproject.toml's [tool.ruff] and [tool.mypy]).
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check detokd
mypy detokd
