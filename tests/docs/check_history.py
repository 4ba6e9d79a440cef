#!/usr/bin/env python3
"""No measurement history in the docs or in code comments.

    check_history.py --source SRC
    check_history.py --self-test

Fails on a date (year-month or year-month-day), a clock time (hours:minutes with a time zone, or
a range of them), a load average ("load" or "load average" and a number) or a commit id (7 to 40
hex digits with a letter and a digit; the patterns are HISTORY below) in
README.md, CONTRIBUTING.md, docs/*.md (docs/results.md's generated header included: it names
the machine, and the commit and time of a run go to the commit message) and in the comments of
src/, include/, cli/, bench/, python/, tools/ and examples/; and when more than 20 comment
lines in src/ carry a GB/s, ms, ns or tokens/s figure. A measured choice's comment states the rule and the command that measures it;
the figures and their history go to commit messages and issues (CONTRIBUTING.md).

--self-test checks that every pattern finds what it is for and passes a clean line, so the
check cannot pass by matching nothing.
"""
import argparse
import os
import re
import sys

HISTORY = [
    ("date", re.compile(r"\b20[2-3]\d-(0[1-9]|1[0-2])(-[0-3]\d)?\b")),
    ("clock time", re.compile(r"\b([01]?\d|2[0-3]):[0-5]\d(:[0-5]\d)?\s*(UTC|CET|CEST|GMT)\b"
                              r"|\b([01]\d|2[0-3]):[0-5]\d\s*-\s*([01]\d|2[0-3]):[0-5]\d\b")),
    ("load average", re.compile(r"\bload(\s+average)?(\s+of)?\s+~?\d", re.I)),
    ("commit id", re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")),
]
FIGURE = re.compile(r"\d(\.\d+)?\s*(GB/s|ms|ns|tokens/s)(?![\w/])")
CODE_DIRS = ("src", "include", "cli", "bench", "python", "tools", "examples")
C_EXT = (".cpp", ".hpp", ".h", ".cc", ".cu", ".cuh", ".c")
HASH_EXT = (".sh", ".py", ".cmake", ".txt", ".supp", ".toml", ".cfg")
NOT_COMMIT = re.compile(r"^\d+e\d+$")


def strip_strings(line):
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', line)


def comments_c(text):
    """(line number, comment text) of // and /* */ comments."""
    out, in_block = [], False
    for n, raw in enumerate(text.split("\n"), 1):
        line = strip_strings(raw) if not in_block else raw
        parts = []
        while line:
            if in_block:
                end = line.find("*/")
                parts.append(line if end < 0 else line[:end])
                if end < 0:
                    line = ""
                else:
                    in_block, line = False, line[end + 2:]
            else:
                a, b = line.find("//"), line.find("/*")
                if a >= 0 and (b < 0 or a < b):
                    parts.append(line[a + 2:])
                    line = ""
                elif b >= 0:
                    in_block, line = True, line[b + 2:]
                else:
                    line = ""
        if parts:
            out.append((n, " ".join(parts)))
    return out


def comments_hash(text):
    out = []
    for n, raw in enumerate(text.split("\n"), 1):
        s = raw.strip()
        if s.startswith("#!"):
            continue
        if s.startswith("#"):
            out.append((n, s[1:]))
            continue
        m = re.search(r"\s#\s(.*)$", strip_strings(raw).replace("'", '"'))
        if m and "$#" not in raw:
            out.append((n, m.group(1)))
    return out


def history_hits(text):
    hits = []
    for name, rx in HISTORY:
        for m in rx.finditer(text):
            if name == "commit id" and NOT_COMMIT.match(m.group(0)):
                continue
            hits.append((name, m.group(0)))
    return hits


def self_test():
    """Each kind of history is found in a comment and in a docs line; a clean line is not."""
    year, sep = "20" + "26", "-"
    samples = {
        "date": "measured on " + year + sep + "12" + sep + "05",
        "clock time": "rerun at 10" + ":38 UTC",
        "load average": "at load " + "1.6",
        "commit id": "since " + "3b9c" + "55d",
    }
    bad = []
    for what, line in samples.items():
        if what not in [w for w, _ in history_hits(line)]:
            bad.append("no %s found in %r" % (what, line))
        if what not in [w for _, c in comments_c("int x;  // " + line) for w, _ in history_hits(c)]:
            bad.append("no %s found in a C++ comment of %r" % (what, line))
    clean = "The tiled layout reads faster for 64-dim heads; `treeattn bench --kernel` measures it."
    if history_hits(clean):
        bad.append("a clean line flagged: %r" % (history_hits(clean),))
    if not FIGURE.search("reads 21.5 GB/s") or FIGURE.search("the msg_size field"):
        bad.append("the figure pattern is wrong")
    for b in bad:
        print("FAIL self-test: " + b)
    print("self-test: %d failures" % len(bad))
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if not a.source:
        ap.error("--source is required")
    src = os.path.abspath(a.source)
    failures, figures = [], []

    def report(rel, n, what, text):
        failures.append("%s:%d: %s: %s" % (rel, n, what, text.strip()[:160]))
    docs = ["README.md", "CONTRIBUTING.md"]
    if os.path.isdir(os.path.join(src, "docs")):
        docs += ["docs/" + f for f in sorted(os.listdir(os.path.join(src, "docs"))) if f.endswith(".md")]
    for rel in docs:
        path = os.path.join(src, rel)
        if not os.path.isfile(path):
            continue
        for n, line in enumerate(open(path, encoding="utf-8"), 1):
            for what, hit in history_hits(line):
                report(rel, n, what + " '" + hit + "'", line)

    for d in CODE_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(src, d)):
            dirnames[:] = [x for x in dirnames if not x.startswith(".") and x != "__pycache__"]
            for f in sorted(filenames):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, src)
                if f.endswith(C_EXT):
                    get = comments_c
                elif f.endswith(HASH_EXT) or f == "CMakeLists.txt" or "." not in f:
                    get = comments_hash
                else:
                    continue
                try:
                    text = open(path, encoding="utf-8").read()
                except (UnicodeDecodeError, OSError):
                    continue
                for n, c in get(text):
                    for what, hit in history_hits(c):
                        report(rel, n, what + " '" + hit + "'", c)
                    if d == "src" and FIGURE.search(c):
                        figures.append("%s:%d: %s" % (rel, n, c.strip()[:160]))

    print("comment lines in src/ with a GB/s, ms, ns or tokens/s figure: %d (at most 20)"
          % len(figures))
    if len(figures) > 20:
        failures.append("%d comment lines in src/ carry a GB/s, ms, ns or tokens/s figure (at most "
                        "20): state the rule and the command that measures it instead" % len(figures))
        failures += ["  " + f for f in figures]
    for line in failures:
        print("FAIL " + line)
    print("docs history: %d failures" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
