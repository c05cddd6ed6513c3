#!/usr/bin/env bash
# Makes sure an etcd server binary is available for the etcd store tests and prints its
# version. Uses Debian's etcd-server package (3.4.x); a no-op if `etcd` is already on PATH.
# Needs root (or sudo) only when it has to install.
set -euo pipefail

if ! command -v etcd >/dev/null 2>&1 && [ ! -x /usr/bin/etcd ]; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq || echo "ensure_etcd: apt-get update failed; trying the install anyway" >&2
  $SUDO apt-get install -y -qq etcd-server etcd-client >/dev/null
fi

ETCD="$(command -v etcd || echo /usr/bin/etcd)"
# Read the whole output before printing its first line: `| head -1` under pipefail dies of
# SIGPIPE (exit 141) whenever etcd writes its second line after head has exited.
version="$("$ETCD" --version 2>&1 || true)"
printf '%s\n' "${version%%$'\n'*}"
