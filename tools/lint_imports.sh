#!/usr/bin/env bash
# Check the layering contracts in pyproject.toml ([tool.importlinter]) with import-linter.
# `server/` installs as `jaxserve.server` through setuptools package-dir, which import-linter's
# graph builder cannot see on disk, so the check runs on a temporary copy laid out as installed.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cp -r "$repo/jaxserve" "$tmp/jaxserve"
rm -rf "$tmp/jaxserve/server"     # a git-ignored jaxserve/server -> ../server link (worktrees)
cp -r "$repo/server" "$tmp/jaxserve/server"
cp "$repo/pyproject.toml" "$tmp/"
cd "$tmp" && PYTHONPATH="$tmp" lint-imports --no-cache
