#!/usr/bin/env python3
"""llama.cpp's multi-host mode for one request: llama-server with its layers split between its own
CPU and an rpc-server on another host (`--rpc HOST:PORT`, GGML_RPC), the prompt of a treeattn
run's JSON (the same token ids), greedy, the server's own timings.

Run inside the host that holds llama-server (bench/engine/dense_split.sh starts the rpc-server on
the other host and runs this in the first, both through tools/cluster). The layers are split as
llama.cpp splits them across devices: --ngl N of the model's repeating layers (the last N) live on
the rpc-server with their KV cache, the rest and the output head on llama-server's CPU. Flash
attention on, f16 KV cache, one slot, no prompt cache, -t / -tb the given threads on both sides.

  llama_rpc_itl.py --llama-server BIN --model GGUF --rpc HOST:PORT --ngl N --ids RUN.json
                   --steps N --threads T --json OUT
Writes OUT: {"decode_ms_p50", "prompt_ms", "steps", "ngl", "rpc", "prompt_tokens", "model"}: the server
reports one mean time per generated token (predicted_per_token_ms), taken as the p50 here.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port():
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rpc", required=True)
    ap.add_argument("--ngl", type=int, required=True)
    ap.add_argument("--ids", required=True, help="a treeattn generate --json whose prompt_tokens to send")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", required=True)
    ap.add_argument("--arch", default="", help="the GGUF's architecture (for --override-kv of its context)")
    ap.add_argument("--trained", type=int, default=0, help="the GGUF's trained context")
    a = ap.parse_args()
    ids = json.load(open(a.ids))["prompt_tokens"]
    ctx = len(ids) + a.steps + 64
    port = free_port()
    cmd = [a.llama_server, "-m", a.model, "--host", "127.0.0.1", "--port", str(port), "-t", str(a.threads),
           "-tb", str(a.threads), "-c", str(ctx), "-np", "1", "-fa", "on", "-b", "512",
           "--rpc", a.rpc, "-ngl", str(a.ngl)]
    if a.arch and a.trained and ctx > a.trained:
        cmd += ["--override-kv", "%s.context_length=int:%d" % (a.arch, ctx)]
    log = open(a.json + ".log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(1200):
            if proc.poll() is not None:
                sys.exit("llama_rpc_itl.py: llama-server exited %d (see %s.log)" % (proc.returncode, a.json))
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/health" % port, timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            sys.exit("llama_rpc_itl.py: llama-server did not start (see %s.log)" % a.json)
        body = {"prompt": ids, "n_predict": a.steps, "temperature": 0, "top_k": 1,
                "cache_prompt": False, "ignore_eos": True}
        req = urllib.request.Request("http://127.0.0.1:%d/completion" % port, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=7200) as r:
                t = json.loads(r.read())["timings"]
        except urllib.error.HTTPError as e:
            sys.exit("llama_rpc_itl.py: llama-server refused the request: %s" % e.read().decode())
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    json.dump({"decode_ms_p50": t["predicted_per_token_ms"], "prompt_ms": t["prompt_ms"],
               "steps": t.get("predicted_n", a.steps), "ngl": a.ngl, "rpc": a.rpc,
               "prompt_tokens": len(ids), "model": os.path.basename(a.model), "llama_server": os.path.basename(a.llama_server)},
              open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
