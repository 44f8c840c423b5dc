#!/usr/bin/env bash
# Install the Anima trainer into ./venv and check it.
#
#   bash install.sh             create or update venv/ (a second run with nothing changed installs nothing)
#   bash install.sh --recreate  delete venv/ first and start clean
#   bash install.sh --which-python   print the Python a new venv would be built from, and do nothing else
#
# Environment:
#   ANIMA_PYTHON      interpreter to build the venv from, or a version (3.11, 3.12, 3.13): pythonX.Y on PATH, else
#                     pyenv's newest X.Y (default: 3.11, else 3.12, else 3.13)
#   ANIMA_VENV        the venv folder (default: venv; CI builds a second one, venv313, from Python 3.13)
#   ANIMA_TORCH_SPEC  what to pip-install when the venv has no working torch (default: "torch torchvision",
#                     i.e. pip chooses the build; e.g. "torch==2.14.1 torchvision==0.29.1" pins it)
set -euo pipefail

cd "$(dirname "$0")"
VENV=${ANIMA_VENV:-venv}
STAMP="$VENV/.anima-train-install"

recreate=0
which_python=0
for arg in "$@"; do
  case "$arg" in
    --recreate) recreate=1 ;;
    --which-python) which_python=1 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option '$arg' (known: --recreate, --which-python)" >&2; exit 2 ;;
  esac
done

say() { printf 'install.sh: %s\n' "$*"; }

version_of() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }

# Python X.Y: pythonX.Y on PATH, else pyenv's newest X.Y.* (found in its folder: pyenv need not be on PATH)
find_version() {
  local want=$1 cand
  for cand in "python$want" $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}/versions/$want".* 2>/dev/null | sort -V -r); do
    [ -d "$cand" ] && cand=$cand/bin/python$want
    if [ "$(version_of "$cand")" = "$want" ]; then echo "$cand"; return; fi
  done
}

pick_python() {
  case "${ANIMA_PYTHON:-}" in
    "") ;;
    3.11|3.12|3.13) find_version "$ANIMA_PYTHON"; return ;;
    *) echo "$ANIMA_PYTHON"; return ;;
  esac
  local want
  for want in 3.11 3.12 3.13; do
    cand=$(find_version "$want")
    if [ -n "$cand" ]; then echo "$cand"; return; fi
  done
  if command -v python3 >/dev/null 2>&1; then
    case "$(version_of python3)" in
      3.11|3.12|3.13) echo python3; return ;;
    esac
  fi
}

if [ "$which_python" = 1 ]; then  # the interpreter a new venv would be built from, and nothing else
  PY=$(pick_python)
  [ -n "$PY" ] && echo "$PY" && exit 0
  echo "install.sh: no Python ${ANIMA_PYTHON:-3.11, 3.12 or 3.13} found (PATH, or pyenv's versions/)" >&2
  exit 1
fi

if [ "$recreate" = 1 ] && [ -d "$VENV" ]; then
  say "--recreate: removing $VENV/"
  rm -rf "$VENV"
fi

if [ ! -x "$VENV/bin/python" ]; then
  PY=$(pick_python)
  if [ -z "$PY" ]; then
    echo "install.sh: no Python ${ANIMA_PYTHON:-3.11, 3.12 or 3.13} found (PATH, or pyenv's versions/). Install one" \
         "(e.g. 'apt-get install python3.11-venv' or pyenv), or point ANIMA_PYTHON at it." >&2
    exit 1
  fi
  ver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  if [ "$ver" != "3.11" ] && [ -z "${ANIMA_PYTHON:-}" ]; then
    say "Python 3.11 not found; falling back to $PY ($ver)"
  fi
  say "creating $VENV/ with $PY ($ver)"
  "$PY" -m venv "$VENV"
fi

PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# torch: ComfyUI (and users with a particular CUDA) own their torch, so only install one when none works.
if "$VENV/bin/python" -c 'import torch, torchvision; torch.ones(1) + 1' >/dev/null 2>&1; then
  say "torch already works in $VENV: $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
else
  spec=${ANIMA_TORCH_SPEC:-"torch torchvision"}
  say "installing $spec (this is the big download on a new machine)"
  # shellcheck disable=SC2086
  "${PIP[@]}" install -q $spec
fi

# The project itself, editable, with test extras. Skipped when nothing it depends on has changed.
want=$(cat pyproject.toml requirements.txt | "$VENV/bin/python" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
   && "$VENV/bin/python" -c 'import anima_train, anchor, pytest' >/dev/null 2>&1 \
   && [ -x "$VENV/bin/anima-train" ]; then
  say "dependencies up to date (pyproject.toml and requirements.txt unchanged)"
else
  say "installing the project (editable) with its dependencies"
  "${PIP[@]}" install -q -e ".[dev]"
  echo "$want" > "$STAMP.tmp" && mv "$STAMP.tmp" "$STAMP"
fi

"$VENV/bin/anima-train" check
say "done. Try: $VENV/bin/anima-train demo"
