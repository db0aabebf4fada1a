#!/usr/bin/env bash
# Installs promtool and the prometheus server (Debian package `prometheus`) when missing.
# Used by CI before tests/deploy (promtool checks) and the metrics integration test
# (a real Prometheus scraping kvshare). Idempotent: does nothing when promtool is on PATH.
set -euo pipefail

if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
    echo "promtool already installed: $(command -v promtool)"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "apt-get not found: install Prometheus (promtool) by hand" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
# --no-install-recommends keeps the node exporter and other extras out.
$SUDO apt-get install -y -q --no-install-recommends prometheus

# The Debian package starts a system service where an init system runs; the tests start their
# own Prometheus on a free port, so stop the packaged one if it came up (harmless when absent).
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
    $SUDO systemctl stop prometheus || true
fi

promtool --version | head -n 1
