"""Runs a snippet in a fresh interpreter, so that a snippet that crashes the interpreter (a
segfault in the extension) or hangs fails the calling test instead of killing the test runner."""

import os
import signal
import subprocess
import sys
import textwrap

PRELUDE = "import numpy as np\nimport treeattn\n"


def describe_exit(returncode):
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def run(code, timeout=60):
    """(returncode, stdout, stderr) of `code` (after PRELUDE) in a child interpreter; a child that
    outlives timeout seconds is killed and reported as returncode None."""
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    try:
        p = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
                           capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return None, out, err
    return p.returncode, p.stdout, p.stderr


# The child prints one line: "RAISED <names of the exception's classes> | <message>" or "RETURNED".
_CATCH = """
try:
{body}
except Exception as e:
    print("RAISED", " ".join(c.__name__ for c in type(e).__mro__), "|", str(e).replace("\\n", " "))
else:
    print("RETURNED")
"""


def outcome(code, timeout=60):
    """What the last statements of `code` did in a child: ("raised", class names, message),
    ("returned", None, None), or ("crashed", None, description)."""
    body = textwrap.indent(textwrap.dedent(code).strip(), "    ")
    rc, out, err = run(_CATCH.format(body=body), timeout)
    if rc is None:
        return "crashed", None, f"still running after {timeout} s"
    if rc != 0:
        return "crashed", None, f"{describe_exit(rc)}; stderr: {err[-2000:]}"
    line = out.strip().splitlines()[-1] if out.strip() else ""
    if line.startswith("RAISED "):
        names, _, message = line[len("RAISED "):].partition(" | ")
        return "raised", names.split(), message
    return "returned", None, None
