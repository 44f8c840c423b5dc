#!/usr/bin/env bash
# The ComfyUI integration tests (`pytest -m comfyui`, browser included) against the ComfyUI snapshot in shared/comfyui/.
#
#   bash .ci/comfyui.sh [extra pytest args]     (after `bash install.sh`; .ci/run calls it)
#   bash .ci/comfyui.sh --prepare                steps 2-3 only (.ci/run builds them while the suites run)
#
# 1. extracts the snapshot (ComfyUI 0.29.0 with Anima; shared/comfyui/README.md) into a temp folder, removed at exit;
# 2. builds ComfyUI's venv by that README's recipe, cached between runs on this machine under
#    $ANIMA_CI_CACHE/comfy-venv-<hash of both requirements files + recipe> (older builds are removed);
# 3. installs Chromium (Debian, apt-get) and playwright-core (npm, tests/browser) when missing;
# 4. runs the comfyui tests with --require-comfyui: a test that would be skipped fails, so a pass means 0 skipped.
#
# Environment: ANIMA_COMFYUI_SNAPSHOT (default: ../shared/comfyui/ComfyUI-4f874c5e.tar.gz beside the checkout),
# ANIMA_CI_CACHE (default: ${XDG_CACHE_HOME:-~/.cache}/anima-train-ci), ANIMA_COMFY_PYTHON (default: python3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
say() { printf '.ci/comfyui.sh: %s\n' "$*"; }
t_start=$SECONDS
prepare_only=0
if [ "${1:-}" = "--prepare" ]; then prepare_only=1; shift; fi

SNAPSHOT=${ANIMA_COMFYUI_SNAPSHOT:-$ROOT/../shared/comfyui/ComfyUI-4f874c5e.tar.gz}
if [ ! -f "$SNAPSHOT" ]; then
  echo ".ci/comfyui.sh: no ComfyUI snapshot at $SNAPSHOT (set ANIMA_COMFYUI_SNAPSHOT to the .tar.gz)" >&2
  exit 1
fi
CACHE=${ANIMA_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/anima-train-ci}
PY=${ANIMA_COMFY_PYTHON:-python3.11}
# the recipe of shared/comfyui/README.md: torch first (pinned), then ComfyUI's and the project's requirements
TORCH_SPEC=(torch==2.9.1 torchvision==0.24.1 "torchaudio==2.9.*")

WORK=$(mktemp -d "${TMPDIR:-/tmp}/anima-comfyci.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
tar -xzf "$SNAPSHOT" -C "$WORK"
COMFY=$(dirname "$(find "$WORK" -maxdepth 3 -name main.py -path '*ComfyUI/main.py' | head -n 1)")
[ -f "$COMFY/requirements.txt" ] || { echo ".ci/comfyui.sh: no ComfyUI/main.py in $SNAPSHOT" >&2; exit 1; }
say "ComfyUI extracted to $COMFY ($((SECONDS - t_start)) s)"

# comment lines do not change what pip installs, so they do not change the key
key=$( { echo "${TORCH_SPEC[*]}"; "$PY" -c 'import sys; print(sys.version)'; grep -hv '^[[:space:]]*#' "$COMFY/requirements.txt" requirements.txt; } \
       | sha256sum | cut -c1-16)
VENV=$CACHE/comfy-venv-$key
if [ -x "$VENV/bin/python" ] && [ -f "$VENV/.complete" ]; then
  say "ComfyUI venv cached: $VENV"
else
  t_venv=$SECONDS
  mkdir -p "$CACHE"
  for old in "$CACHE"/comfy-venv-*; do  # earlier requirements: ~8 GB each
    [ -e "$old" ] && [ "$old" != "$VENV" ] && rm -rf "$old"
  done
  say "building ComfyUI's venv in $VENV (about 7 minutes on a new machine)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "${TORCH_SPEC[@]}"
  "$VENV/bin/pip" install -q --disable-pip-version-check -r "$COMFY/requirements.txt" -r requirements.txt
  touch "$VENV/.complete"
  say "ComfyUI venv built ($((SECONDS - t_venv)) s)"
fi

if ! command -v chromium >/dev/null 2>&1 && [ -z "${CHROMIUM:-}" ]; then
  say "installing Chromium (apt-get)"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null
fi
if ! (cd tests/browser && node -e "require.resolve('playwright-core')" >/dev/null 2>&1); then
  say "installing playwright-core (npm, tests/browser)"
  npm install --prefix tests/browser --no-audit --no-fund --loglevel=error
fi
if [ "$prepare_only" = 1 ]; then say "--prepare: environment ready in $((SECONDS - t_start)) s"; exit 0; fi
say "environment ready in $((SECONDS - t_start)) s; running the comfyui tests (pytest's last line gives their time)"

# pytest's summary stays the last line; its exit status is this script's (set -e; the trap removes the temp copy)
COMFYUI_PATH=$COMFY COMFYUI_PYTHON=$VENV/bin/python \
  venv/bin/python -m pytest -m comfyui --require-comfyui -p no:cacheprovider "$@"
