#!/usr/bin/env python3
"""Writes what llama.cpp says about the real Gemma 3 270M file, for tests/model/test_gemma3.cpp.

Run outside CI (the output is committed as tests/model/data/gemma3_llamacpp.json). Starts
llama.cpp's own llama-server (build/llama-server/bin/llama-server, or $LLAMA_SERVER) on the
file (tools/model-path.sh gemma-3-270m) and saves:
  * tokenize: llama.cpp's ids (POST /tokenize) for every string of the tokenizer corpus
    (CORPUS of make_tokenizer_fixture.py), with special tokens parsed and not, BOS added;
  * generate: greedy continuations (temperature 0, top_k 1, cache_prompt false) of prompts given
    as token ids, with the top-3 log-probabilities before sampling at every step (n_probs), so
    the test can excuse near ties.

Usage: build/ref-venv/bin/python tests/model/make_gemma3_fixture.py
"""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from make_tokenizer_fixture import CORPUS  # noqa: E402

SERVER = os.environ.get("LLAMA_SERVER",
                        os.path.join(ROOT, "build", "llama-server", "bin", "llama-server"))
PROMPTS = [
    "Question: What is the capital of France?\nAnswer:",
    "The capital of France is Paris.  Hello\n\nworld 12345 h\u00e9llo \u65e5\u672c\u8a9e \U0001f389",
    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
]


def post(port, path, body):
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path),
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def main():
    model = subprocess.run([os.path.join(ROOT, "tools", "model-path.sh"), "gemma-3-270m"],
                           capture_output=True, text=True, check=True).stdout.strip()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([SERVER, "-m", model, "--port", str(port), "-t", "2", "-c", "2048",
                             "-np", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(120):
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/health" % port, timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        tokenize = []
        for text in CORPUS:
            for parse in (True, False):
                ids = post(port, "/tokenize", {"content": text, "add_special": True,
                                               "parse_special": parse})["tokens"]
                tokenize.append({"text": text, "parse_special": parse, "ids": ids})
        generate = []
        for text in PROMPTS:
            ids = post(port, "/tokenize", {"content": text, "add_special": True,
                                           "parse_special": True})["tokens"]
            r = post(port, "/completion", {"prompt": ids, "n_predict": 16, "temperature": 0,
                                           "top_k": 1, "cache_prompt": False, "n_probs": 3,
                                           "post_sampling_probs": False})
            steps = [[[t["id"], t["logprob"]] for t in p["top_logprobs"]]
                     for p in r["completion_probabilities"]]
            generate.append({"text": text, "prompt": ids, "tokens": [s[0][0] for s in steps],
                             "top3": steps, "content": r["content"]})
        version = open(os.path.join(ROOT, "build", "llama-server", "VERSION")).read().strip()
        out = {"model": os.path.basename(model), "llama_cpp": version, "tokenize": tokenize,
               "generate": generate}
        path = os.path.join(HERE, "data", "gemma3_llamacpp.json")
        with open(path, "w") as f:
            json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
        print("wrote", path, os.path.getsize(path), "bytes")
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
