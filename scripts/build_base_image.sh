#!/usr/bin/env bash
# A local stand-in for python:3.11-slim-bookworm, for hosts that cannot reach Docker Hub:
# Debian bookworm made with debootstrap (minbase) plus Debian's python3.11 and venv, then
# `docker import`ed. The Dockerfile takes it as a build argument:
#   scripts/build_base_image.sh                      # -> kvshare-base:bookworm-py311
#   docker build --network host --build-arg PYTHON_IMAGE=kvshare-base:bookworm-py311 ...
# Needs root, debootstrap (apt-get install debootstrap) and a Debian mirror.
# The base trusts the CAs this host added (/usr/local/share/ca-certificates, e.g. a TLS-
# intercepting egress proxy's), so pip in the build reaches PyPI where the host does.
# Usage: scripts/build_base_image.sh [TAG] [MIRROR]
set -euo pipefail

TAG=${1:-kvshare-base:bookworm-py311}
MIRROR=${2:-http://deb.debian.org/debian}
SUITE=bookworm

command -v debootstrap >/dev/null || { echo "debootstrap missing: apt-get install debootstrap" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "debootstrap needs root" >&2; exit 1; }

ROOTFS=$(mktemp -d /tmp/kvshare-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT

# python3-venv brings ensurepip, so `python3 -m venv` gives a venv with pip, as in the
# official image; ca-certificates lets pip and apt use https.
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$SUITE" "$ROOTFS" "$MIRROR"

# The same sources a Debian image has: the release, its updates and the security fixes.
cat >"$ROOTFS/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb http://deb.debian.org/debian-security $SUITE-security main
EOF
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$ROOTFS/usr/local/share/ca-certificates/"
    chroot "$ROOTFS" update-ca-certificates
fi
# What a container image does not need: package lists, caches, docs and man pages.
chroot "$ROOTFS" apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin \
    "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/*
# `python` as in the official image, which the tools there expect.
ln -sf python3 "$ROOTFS/usr/bin/python"

chmod 755 "$ROOTFS"  # mktemp's 0700 would become the image's /, closed to non-root users
tar -C "$ROOTFS" --numeric-owner -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$TAG"
docker image inspect --format '{{.RepoTags}} {{.Size}} bytes' "$TAG"
