#!/usr/bin/env bash
# Install headless Chromium (Debian package `chromium`) for the HTML report browser test, when missing.
# Idempotent: does nothing when a Chromium binary is already on PATH (or $IVQ_CHROMIUM points at one).
# Needs root (or sudo) and access to the Debian archive; on other systems install Chromium yourself and
# set IVQ_CHROMIUM=/path/to/chromium. Exit 0 when Chromium is available afterwards.
set -euo pipefail

find_chromium() {
  if [ -n "${IVQ_CHROMIUM:-}" ] && [ -x "${IVQ_CHROMIUM}" ]; then
    echo "${IVQ_CHROMIUM}"; return 0
  fi
  for b in chromium chromium-browser google-chrome-stable google-chrome chrome; do
    if command -v "$b" >/dev/null 2>&1; then command -v "$b"; return 0; fi
  done
  return 1
}

if bin=$(find_chromium); then
  echo "chromium: already installed ($bin)"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-chromium: no apt-get here; install Chromium yourself and set IVQ_CHROMIUM" >&2
  exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "install-chromium: need root (or sudo) to apt-get install chromium" >&2
    exit 1
  fi
fi

export DEBIAN_FRONTEND=noninteractive
# Update the package lists only when they are missing or stale (older than a day).
if [ -z "$(find /var/lib/apt/lists -maxdepth 1 -name '*Packages*' -mtime -1 2>/dev/null | head -n 1)" ]; then
  $SUDO apt-get update -q
fi
$SUDO apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core

bin=$(find_chromium) || { echo "install-chromium: chromium still not found after install" >&2; exit 1; }
echo "chromium: installed ($bin: $("$bin" --version 2>/dev/null || echo unknown version))"
