#!/usr/bin/env python3
"""The commands in README.md, CONTRIBUTING.md and docs/*.md stay true.

    check_commands.py --source SRC --build BUILD [--no-run] [--only FILE]

Every fenced sh/bash block is one of:
  run as written   no marker: runs with bash -e in SRC, `build/release` replaced by BUILD;
  run instead      `<!-- docs-test: COMMAND -->` on the line before the fence: COMMAND runs in
                   its place, with small sizes (exit 77: skipped, e.g. no model here);
  illustrative     `<!-- illustrative: why -->` on the line before the fence: not run.
Every `treeattn SUB ... --flag` in a block, and every --flag named in a `## treeattn SUB` section
of docs/cli.md, must appear in `treeattn SUB --help`. Exit 1 listing what failed.
"""
import argparse
import glob
import os
import re
import subprocess
import sys
import time

FENCE = re.compile(r"^```\s*([A-Za-z0-9_+-]*)\s*$")
MARK = re.compile(r"^<!--\s*(illustrative|docs-test)\s*:?\s*(.*?)\s*-->\s*$")
SUBS = ("run", "bench", "verify", "generate", "serve", "plan", "topo", "tune")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def doc_files(src):
    files = [os.path.join(src, f) for f in ("README.md", "CONTRIBUTING.md")]
    files += sorted(glob.glob(os.path.join(src, "docs", "*.md")))
    return [f for f in files if os.path.isfile(f)]


def blocks(path):
    """(line number, language, marker kind, marker text, body) for every fenced block."""
    out, lines = [], open(path, encoding="utf-8").read().split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1), i
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mk = MARK.match(prev.strip())
        out.append((start + 1, lang, mk.group(1) if mk else None, mk.group(2) if mk else "",
                    "\n".join(lines[start + 1:j])))
        i = j + 1
    return out


def anchors(path):
    out = set()
    for line in open(path, encoding="utf-8"):
        m = re.match(r"^#+\s+(.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def broken_links(src, files):
    """Relative links between the docs whose file or heading is missing."""
    bad = []
    for f in files:
        for m in re.finditer(r"\]\(([^)\s]+)\)", open(f, encoding="utf-8").read()):
            link = m.group(1)
            if re.match(r"^[a-z]+:", link):
                continue
            path, _, frag = link.partition("#")
            target = os.path.normpath(os.path.join(os.path.dirname(f), path)) if path else f
            if not os.path.exists(target):
                bad.append("%s: link to a missing file: %s" % (os.path.relpath(f, src), link))
            elif frag and target.endswith(".md") and frag not in anchors(target):
                bad.append("%s: link to a missing heading: %s" % (os.path.relpath(f, src), link))
    return bad


def helps(binary):
    h = {}
    for sub in SUBS:
        r = subprocess.run([binary, sub, "--help"], capture_output=True, text=True, timeout=60)
        text = r.stdout + r.stderr
        h[sub] = None if "not in this build" in text else set(FLAG.findall(text))
    return h


def invocations(text):
    """(subcommand, [flags]) for each treeattn call in a shell block."""
    text = re.sub(r"\\\n", " ", text)
    uses_b = re.search(r"^\s*B=\S*treeattn\b", text, re.M)
    calls = []
    for line in text.split("\n"):
        line = re.sub(r"(^|\s)#.*$", "", line)  # comments
        for piece in re.split(r"\|\||&&|[|;&]", line):
            words = piece.split()
            for k, w in enumerate(words):
                if (w.endswith("/treeattn") or w == "treeattn" or (uses_b and w == "$B")) \
                        and k + 1 < len(words) and words[k + 1] in SUBS:
                    calls.append((words[k + 1], [x for x in words[k + 2:] if FLAG.fullmatch(x.split("=")[0])]))
                    break
    return calls


def cli_sections(src):
    path = os.path.join(src, "docs", "cli.md")
    if not os.path.isfile(path):
        return {}
    out, cur = {}, None
    for line in open(path, encoding="utf-8"):
        m = re.match(r"^## treeattn (\w+)", line)
        if m:
            cur = m.group(1)
            out[cur] = set()
        elif line.startswith("## "):
            cur = None
        elif cur:
            out[cur] |= set(FLAG.findall(line))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", required=True)
    ap.add_argument("--build", required=True)
    ap.add_argument("--no-run", action="store_true", help="check markers and flags only")
    ap.add_argument("--only", help="one file (path relative to the source)")
    ap.add_argument("--timeout", type=int, default=150, help="seconds per block")
    a = ap.parse_args()
    src, build = os.path.abspath(a.source), os.path.abspath(a.build)
    binary = os.path.join(build, "cli", "treeattn")
    if not os.access(binary, os.X_OK):
        print("check_commands: %s not built" % binary)
        return 1
    h = helps(binary)
    failures, ran, skipped, illustrative = broken_links(src, doc_files(src)), 0, 0, 0

    def check_flags(where, sub, flags):
        if h.get(sub) is None:
            return
        for f in flags:
            if f not in h[sub]:
                failures.append("%s: treeattn %s %s: no such flag in `treeattn %s --help`" % (
                    where, sub, f, sub))

    for sub, flags in cli_sections(src).items():
        if sub not in SUBS:
            failures.append("docs/cli.md: section '## treeattn %s': no such subcommand" % sub)
            continue
        check_flags("docs/cli.md (section treeattn %s)" % sub, sub, sorted(flags))

    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1",
               TREEATTN_TUNE="0", TREEATTN_BUILD=build)
    files = doc_files(src)
    if a.only:
        files = [os.path.join(src, a.only)]
    for path in files:
        rel = os.path.relpath(path, src)
        for line, lang, kind, mark, body in blocks(path):
            if lang not in ("sh", "bash"):
                continue
            where = "%s:%d" % (rel, line)
            for sub, flags in invocations(body) + (invocations(mark) if kind == "docs-test" else []):
                check_flags(where, sub, flags)
            if kind == "illustrative":
                illustrative += 1
                continue
            if kind == "docs-test" and not mark:
                failures.append("%s: `<!-- docs-test: -->` without a command" % where)
                continue
            script = mark if kind == "docs-test" else body
            script = script.replace("$PWD/build/release", build).replace("build/release", build)
            needs = [s for s in ("generate", "serve") if re.search(r"\b%s\b" % s, script)]
            if any(h.get(s) is None for s in needs):
                print("skipped %s: this build has no %s" % (where, "/".join(needs)))
                skipped += 1
                continue
            if a.no_run:
                continue
            t0 = time.time()
            try:
                r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=src, env=env,
                                   capture_output=True, text=True, timeout=a.timeout)
                rc, output = r.returncode, r.stdout + r.stderr
            except subprocess.TimeoutExpired as e:
                rc, output = -1, "timed out after %d s\n%s" % (a.timeout, e.stdout or "")
            if rc == 77:
                print("skipped %s (exit 77): %s" % (where, output.strip().splitlines()[-1:] or ""))
                skipped += 1
                continue
            ran += 1
            print("%s %s (%.1f s)" % ("ok  " if rc == 0 else "FAIL", where, time.time() - t0))
            if rc != 0:
                tail = "\n".join(output.strip().splitlines()[-15:])
                failures.append("%s: exit %d\n    %s\n  output:\n%s" % (
                    where, rc, script.replace("\n", "\n    "), tail))
    print("docs commands: %d run, %d skipped, %d illustrative, %d failures" % (
        ran, skipped, illustrative, len(failures)))
    for f in failures:
        print("FAIL " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
