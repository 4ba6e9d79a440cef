#!/usr/bin/env python3
"""Fails when a function body in the given C++ files (or *.cpp of given directories) is longer
than --max lines. A brace-matching scan: comments, string and character literals are blanked
first; a brace opens a function body when the text before it (back to the previous ';', '{' or
'}') ends like a signature (')' or ') const', 'noexcept', 'override', 'final', '-> Type', a
constructor's initializer list) and does not start with a control keyword. Blocks, lambdas and
local classes inside a function count toward that function. The length is the number of lines
from the line after the opening brace to the line of the closing brace, both included.

--self-test checks that a 121-line body fails at --max 120 and a 120-line body passes."""
import argparse
import os
import re
import sys
import tempfile

CONTROL = re.compile(r"^\s*(if|for|while|switch|catch|do|else|return|case)\b")
SIGNATURE_END = re.compile(
    r"\)\s*(const|noexcept|override|final|mutable|&|&&|\s)*(->\s*[\w:<>,\s*&]+)?$")


def blank(text):
    """Comments and literals replaced by spaces (newlines kept), so braces in them are ignored."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == 'R' and text.startswith('R"', i):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) if m else -1
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(" " * (j - i))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def looks_like_function(head):
    head = " ".join(head.split())
    if not head or CONTROL.match(head):
        return False
    if re.match(r"^(namespace|struct|class|union|enum)\b", head) or head.startswith("extern "):
        return False
    if SIGNATURE_END.search(head):
        return True
    # A constructor's initializer list: Type::Type(...) : a_(x), b_{y}
    return bool(re.search(r"\)\s*:\s*[\w:]+\s*[({]", head)) and not head.startswith("=")


def functions(path):
    """(name line, first body line, last body line, head) of every function body."""
    text = blank(open(path, encoding="utf-8").read())
    found, stack, seg_start, line = [], [], 0, 1
    for i, c in enumerate(text):
        if c == "\n":
            line += 1
        elif c == "{":
            inside = any(kind == "fn" for kind, _, _ in stack)
            head = text[seg_start:i].strip()
            kind = "fn" if not inside and looks_like_function(head) else "block"
            stack.append((kind, line, head))
            seg_start = i + 1
        elif c == "}":
            if stack:
                kind, start, head = stack.pop()
                if kind == "fn":
                    found.append((start, line, " ".join(head.split())[-80:]))
            seg_start = i + 1
        elif c == ";":
            seg_start = i + 1
    return found


def check(paths, limit):
    bad, longest = [], (0, "", "")
    for path in paths:
        for start, end, head in functions(path):
            length = end - start
            if length > longest[0]:
                longest = (length, f"{path}:{start}", head)
            if length > limit:
                bad.append(f"{path}:{start}: {length} lines (> {limit}): {head}")
    return bad, longest


def expand(args):
    files = []
    for a in args:
        if os.path.isdir(a):
            files += sorted(os.path.join(a, f) for f in os.listdir(a) if f.endswith(".cpp"))
        else:
            files.append(a)
    return files


def self_test():
    def body(n):  # a function whose body spans n lines by the count above
        inner = "".join(f"  x += {k};  // {{ not a brace\n" for k in range(n - 2))
        return f"int f(int x) {{\n{inner}  return x;\n}}\n"
    ok = True
    with tempfile.TemporaryDirectory() as d:
        for n, want_fail in ((121, True), (120, False)):
            p = os.path.join(d, f"f{n}.cpp")
            with open(p, "w") as f:
                f.write("namespace a {\nstruct S {\n  int g() const {\n    return 1;\n  }\n};\n")
                f.write(body(n) + "}  // namespace a\n")
            bad, longest = check([p], 120)
            if bool(bad) != want_fail or longest[0] != n:
                print(f"self-test: a {n}-line body gave {bad or 'no failure'} "
                      f"(longest {longest[0]})")
                ok = False
    print("self-test:", "ok" if ok else "FAILED")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max", type=int, default=120)
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("paths", nargs="*")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    files = expand(a.paths)
    if not files:
        print("no C++ files given")
        return 2
    bad, longest = check(files, a.max)
    print(f"{len(files)} files; longest function body {longest[0]} lines at {longest[1]}: "
          f"{longest[2]}")
    for b in bad:
        print(b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
