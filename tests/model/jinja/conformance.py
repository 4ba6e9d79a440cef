#!/usr/bin/env python3
"""Renders every template of data/templates (and data/features) with Python's jinja2 configured as Hugging Face
transformers renders chat templates (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
loopcontrols, the {% generation %} block, HF's tojson, raise_exception, strftime_now) over the
conversations of data/conversations.json, with add_generation_prompt true and false, and checks
that jinja_render (the C++ interpreter) writes the same bytes. Where jinja2 raises, jinja_render
must fail too (with the template's own message when it is raise_exception's).

    conformance.py JINJA_RENDER DATA_DIR [--only NAME]
"""
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


class GenerationBlock(Extension):
    """HF's AssistantTracker without the mask bookkeeping: {% generation %} renders its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class TemplateRaised(Exception):
    pass


def hf_environment():
    def raise_exception(message):
        raise TemplateRaised(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def main():
    render_bin, data = sys.argv[1], sys.argv[2]
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    env = hf_environment()
    with open(os.path.join(data, "conversations.json"), encoding="utf-8") as f:
        conversations = json.load(f)
    with open(os.path.join(data, "templates.json"), encoding="utf-8") as f:
        tokens = json.load(f)
    # The real templates, and small ones of data/features that exercise the language.
    names = sorted(os.path.join("templates", n) for n in os.listdir(os.path.join(data, "templates"))
                   if n.endswith(".jinja"))
    names += sorted(os.path.join("features", n) for n in os.listdir(os.path.join(data, "features"))
                    if n.endswith(".jinja"))
    if only:
        names = [n for n in names if only in n]
    cases = mismatches = both_failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            path = os.path.join(data, name)
            with open(path, encoding="utf-8") as f:
                source = f.read()
            tok = tokens.get(os.path.basename(name), tokens["default"])
            try:
                template = env.from_string(source)
            except jinja2.TemplateError as e:
                print(f"FAIL {name}: jinja2 cannot parse it ({e}); remove it from the data")
                mismatches += 1
                continue
            cases_here = []
            for conv in conversations:
                for agp in (True, False):
                    ctx = {"messages": conv["messages"], "tools": conv.get("tools"),
                           "documents": None, "add_generation_prompt": agp,
                           "bos_token": tok["bos_token"], "eos_token": tok["eos_token"]}
                    cases_here.append((f"{name} / {conv['name']} / add_generation_prompt={agp}",
                                       ctx))
            ctx_path = os.path.join(tmp, "contexts.jsonl")
            with open(ctx_path, "w", encoding="utf-8") as f:
                for _, ctx in cases_here:
                    f.write(json.dumps(ctx, ensure_ascii=False) + "\n")
            p = subprocess.run([render_bin, path, "--batch", ctx_path], capture_output=True)
            if p.returncode != 0:
                print(f"FAIL {name}: jinja_render cannot use it: "
                      f"{p.stderr.decode('utf-8', 'replace').strip()}")
                mismatches += len(cases_here)
                cases += len(cases_here)
                continue
            results = [json.loads(line) for line in p.stdout.decode("utf-8").split("\n") if line]
            if len(results) != len(cases_here):
                print(f"FAIL {name}: jinja_render answered {len(results)} of {len(cases_here)}")
                mismatches += 1
                continue
            for (case, ctx), res in zip(cases_here, results):
                cases += 1
                try:
                    expected, error = template.render(**ctx), None
                except Exception as e:  # the template raised, or jinja2 did
                    expected, error = None, e
                got, err = res.get("text"), res.get("error", "")
                if error is not None:
                    if got is not None:
                        print(f"FAIL {case}: jinja2 raised {type(error).__name__}: {error}; "
                              f"jinja_render rendered {got!r}")
                        mismatches += 1
                    elif isinstance(error, TemplateRaised) and str(error) not in err:
                        print(f"FAIL {case}: jinja2 raised {error!r}; jinja_render said {err}")
                        mismatches += 1
                    else:
                        both_failed += 1
                    continue
                if got is None:
                    print(f"FAIL {case}: jinja_render failed: {err}")
                    mismatches += 1
                elif got != expected:
                    k = next((i for i in range(min(len(got), len(expected)))
                              if got[i] != expected[i]), min(len(got), len(expected)))
                    print(f"FAIL {case}: differs at character {k}:\n"
                          f"  jinja2:       {expected[max(0, k - 40):k + 40]!r}\n"
                          f"  jinja_render: {got[max(0, k - 40):k + 40]!r}")
                    mismatches += 1
    print(f"conformance: {len(names)} templates, {cases} renders, {mismatches} mismatches, "
          f"{both_failed} raised in both (jinja2 {jinja2.__version__})")
    return 1 if mismatches or not names else 0


if __name__ == "__main__":
    sys.exit(main())
