#!/usr/bin/env python3
"""Writes what llama.cpp says about the real Qwen2.5 files, for tests/model/test_real_models.cpp.

Run outside CI (the outputs are committed as fixtures). For each real model present in models/
(tools/model-path.sh NAME), the script starts llama.cpp's own llama-server on the CPU (-t 2, a
free port on 127.0.0.1, --ctx-size 4096, one slot) and saves tests/model/data/real_NAME.json:

  * tokenize: llama.cpp's ids for every string of the tokenizer corpus (CORPUS of
    make_tokenizer_fixture.py) through POST /tokenize {content, add_special, parse_special}:
    parse_special true and false for every string, add_special true for the first two.
  * generate: greedy continuations (temperature 0, top_k 1, n_predict 24, cache_prompt false)
    through POST /completion with the prompt given as token ids, and with n_probs 2: llama.cpp's
    top-2 log-probabilities before sampling at every step (a softmax of the raw logits, so their
    difference is the logit gap), for the test to excuse near ties. The chat prompt is what
    llama-server's POST /apply-template renders from the model's own template for the one user
    message "What is the capital of France?" (Qwen2.5's template inserts its default system
    message); the test checks that format_chatml with Tokenizer::default_system() gives the same.

Usage: build/ref-venv/bin/python tests/model/make_real_model_fixture.py [NAME...]
  (default: both Qwen2.5-Coder models, those fetched; needs build/llama-server/bin/llama-server
  or $LLAMA_SERVER, and numpy + gguf, which make_tokenizer_fixture.py imports)
"""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from make_tokenizer_fixture import CORPUS  # noqa: E402  (the same strings as the SmolLM2 fixture)

MODELS = ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
SERVER = os.environ.get("LLAMA_SERVER",
                        os.path.join(ROOT, "build", "llama-server", "bin", "llama-server"))
N_PREDICT = 24
CHAT_QUESTION = "What is the capital of France?"
# Plain-text prompts (tokenized by llama.cpp with parse_special, no BOS), then the chat prompt.
TEXT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "The history of the Roman Empire spans many centuries, from the founding of the city to "
    "the fall of Constantinople. Historians divide it into periods: the Kingdom, the Republic "
    "and the Empire, each with its own institutions, wars and culture. In this essay we",
]


def model_path(name):
    r = subprocess.run([os.path.join(ROOT, "tools", "model-path.sh"), name],
                       capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, path, body):
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path),
                                 data=json.dumps(body).encode("utf-8"),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read().decode("utf-8"))


def get(port, path):
    with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=30) as r:
        return json.loads(r.read().decode("utf-8"))


def start_server(path, port, log):
    cmd = [SERVER, "-m", path, "-t", "2", "-tb", "2", "--host", "127.0.0.1", "--port", str(port),
           "--ctx-size", "4096", "-np", "1", "--no-webui", "--jinja"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("llama-server exited %d (log: %s)" % (proc.returncode, log.name))
        try:
            if get(port, "/health").get("status") == "ok":
                return proc
        except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("llama-server did not become ready in 300 s (log: %s)" % log.name)


def tokenize(port, text, add_special, parse_special):
    return post(port, "/tokenize", {"content": text, "add_special": add_special,
                                    "parse_special": parse_special})["tokens"]


def greedy(port, ids):
    r = post(port, "/completion", {
        "prompt": ids, "n_predict": N_PREDICT, "temperature": 0.0, "top_k": 1,
        "cache_prompt": False, "n_probs": 2, "return_tokens": True, "stream": False})
    steps = r["completion_probabilities"]
    tokens = [s["id"] for s in steps]
    if r.get("tokens") and r["tokens"] != tokens[:len(r["tokens"])]:
        raise RuntimeError("tokens %s disagree with the probabilities' ids %s" % (r["tokens"],
                                                                                  tokens))
    top2 = [[[p["id"], round(p["logprob"], 6)] for p in s["top_logprobs"][:2]] for s in steps]
    return {"tokens": tokens, "top2": top2, "stop_type": r.get("stop_type"),
            "answer": r.get("content")}


def fixture_for(name, path):
    port = free_port()
    log_path = os.path.join("/tmp", "llama-server-%s-%d.log" % (name, port))
    with open(log_path, "w") as log:
        proc = start_server(path, port, log)
        try:
            props = get(port, "/props")
            cases = []
            for text in CORPUS:
                for parse_special in (True, False):
                    cases.append({"text": text, "add_special": False,
                                  "parse_special": parse_special,
                                  "ids": tokenize(port, text, False, parse_special)})
            for text in CORPUS[:2]:
                cases.append({"text": text, "add_special": True, "parse_special": True,
                              "ids": tokenize(port, text, True, True)})
            chat = post(port, "/apply-template",
                        {"messages": [{"role": "user", "content": CHAT_QUESTION}]})["prompt"]
            prompts = [{"name": "text%d" % i, "text": t} for i, t in enumerate(TEXT_PROMPTS)]
            prompts.append({"name": "chat", "text": chat})
            gens = []
            for p in prompts:
                ids = tokenize(port, p["text"], False, True)
                g = greedy(port, ids)
                gens.append(dict(name=p["name"], text=p["text"], prompt=ids, **g))
                print("%s %s: %d prompt tokens -> %r" % (name, p["name"], len(ids), g["answer"]))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    version = subprocess.run([SERVER, "--version"], capture_output=True, text=True)
    version = " ".join(l.strip() for l in (version.stdout + version.stderr).splitlines()
                       if l.startswith("version") or l.startswith("built"))
    vfile = os.path.join(os.path.dirname(os.path.dirname(SERVER)), "VERSION")
    vendored = open(vfile).read().strip() if os.path.exists(vfile) else "?"
    return {
        "model": os.path.basename(path),
        "bytes": os.path.getsize(path),
        "source": "llama.cpp llama-server (%s; vendored by %s; build_info %s), CPU -t 2, "
                  "--ctx-size 4096: POST /tokenize, POST /apply-template, POST /completion "
                  "temperature 0 top_k 1 n_predict %d cache_prompt false n_probs 2 (top-2 "
                  "log-probabilities before sampling)" % (version, vendored,
                                                          props.get("build_info", "?"), N_PREDICT),
        "tokenize": cases,
        "generate": gens,
    }


def write(fixture, out):
    # One case per line: readable diffs, ASCII escapes keep control characters visible.
    with open(out, "w", encoding="utf-8") as f:
        head = {k: v for k, v in fixture.items() if k not in ("tokenize", "generate")}
        f.write(json.dumps(head)[:-1] + ',\n "tokenize": [\n')
        f.write(",\n".join("  " + json.dumps(c) for c in fixture["tokenize"]))
        f.write('\n ],\n "generate": [\n')
        f.write(",\n".join("  " + json.dumps(g) for g in fixture["generate"]))
        f.write("\n ]\n}\n")


def main():
    names = sys.argv[1:] or MODELS
    for name in names:
        path = model_path(name)
        if path is None:
            print("%s: not fetched (tools/fetch-model.sh %s), skipped" % (name, name))
            continue
        out = os.path.join(HERE, "data", "real_%s.json" % name)
        write(fixture_for(name, path), out)
        print("wrote %s (%d bytes)" % (out, os.path.getsize(out)))


if __name__ == "__main__":
    main()
