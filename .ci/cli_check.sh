#!/usr/bin/env bash
# The `flashtile` command on a plain install, as a newcomer gets it: a fresh virtual
# environment (outside the checkout) with only the CPU build of torch and flashtile's declared
# dependencies (`pip install -e .`, no extras: no Triton, no matplotlib).  Checks that
#   * --version, info, iomodel and bench --quick exit 0;
#   * every malformed flag exits 2 with exactly one line on stderr and no traceback;
#   * `python -m flashtile` beside a folder named flashtile says what is wrong in one line;
#   * `flashtile info | head -1` ends without a traceback;
#   * nothing of this changes `git status --porcelain`: a run leaves the checkout as it was.
# Results go to the default per-user folder, here a temporary $XDG_CACHE_HOME.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export XDG_CACHE_HOME="$TMP/cache"
export PIP_DISABLE_PIP_VERSION_CHECK=1
unset TRITON_INTERPRET

before=$(git status --porcelain)

python3 -m venv "$TMP/venv"
# shellcheck disable=SC1091
. "$TMP/venv/bin/activate"
if ! { pip install -q torch==2.13.0 && pip install -q -e .; } >"$TMP/pip.log" 2>&1; then
  tail -n 30 "$TMP/pip.log"
  echo "cli_check: install failed"
  exit 1
fi

failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

if python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('triton') is None)"; then
  fail "triton is installed in the plain environment"
fi

ok() {  # ok ARGS...: exits 0, no traceback
  local out rc
  out=$("$@" 2>&1); rc=$?
  if [ $rc -ne 0 ] || grep -q Traceback <<<"$out"; then
    fail "'$*' exited $rc:"; tail -n 5 <<<"$out"
  else
    echo "ok    $* ($(wc -l <<<"$out") lines)"
  fi
}

usage_error() {  # usage_error ARGS...: exits 2, exactly one line on stderr, no traceback
  local rc lines
  "$@" >"$TMP/out" 2>"$TMP/err"; rc=$?
  lines=$(wc -l <"$TMP/err")
  if [ $rc -ne 2 ] || [ "$lines" -ne 1 ] || grep -q Traceback "$TMP/out" "$TMP/err"; then
    fail "'$*' exited $rc with $lines line(s) on stderr:"; head -n 5 "$TMP/err"
  else
    echo "ok    $*  ->  $(cat "$TMP/err")"
  fi
}

ok flashtile --version
ok flashtile info
ok flashtile iomodel
ok flashtile bench --quick --no-progress
[ -s "$XDG_CACHE_HOME/flashtile/attention_cpu.jsonl" ] || fail "bench --quick wrote no $XDG_CACHE_HOME/flashtile/attention_cpu.jsonl"
ok python -m flashtile info

touch "$TMP/a-file"
usage_error flashtile bench --seqlens -5
usage_error flashtile bench --seqlens 0
usage_error flashtile bench --batch -1
usage_error flashtile bench --nheads x
usage_error flashtile bench --headdim 300
usage_error flashtile bench --headdim 0
usage_error flashtile bench --device tpu
usage_error flashtile bench --out "$TMP/a-file/results"
usage_error flashtile iomodel --seqlens 0
usage_error flashtile iomodel --dtype int8
usage_error flashtile no-such-command
usage_error flashtile --no-such-flag

mkdir -p "$TMP/parent/flashtile"
(cd "$TMP/parent" && usage_error python -m flashtile info)

flashtile info 2>"$TMP/err" | head -n 1 >/dev/null
if grep -q Traceback "$TMP/err"; then fail "flashtile info | head -1 ended in a traceback"; head -n 5 "$TMP/err"; fi

deactivate
after=$(git status --porcelain)
if [ "$before" != "$after" ]; then
  fail "the run changed the checkout (git status --porcelain):"
  diff <(echo "$before") <(echo "$after")
fi

if [ $failures -ne 0 ]; then
  echo "cli_check: $failures failure(s)"
  exit 1
fi
echo "cli_check: all passed (in $ROOT)"
