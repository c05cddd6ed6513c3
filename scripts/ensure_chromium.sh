#!/usr/bin/env bash
# Makes sure Debian's headless-capable Chromium is present for the status-page test
# (tests/services/test_metrics.py takes a screenshot with it). A no-op if installed.
set -euo pipefail
if ! command -v chromium >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq || echo "ensure_chromium: apt-get update failed; trying the install anyway" >&2
  $SUDO apt-get install -y -qq chromium >/dev/null || echo "ensure_chromium: chromium not installed; the page test will skip" >&2
fi
command -v chromium >/dev/null 2>&1 && { v="$(chromium --version 2>/dev/null || true)"; printf '%s\n' "${v%%$'\n'*}"; } || true
