#!/usr/bin/env python3
"""llama.cpp's multi-host mode for one request: llama-server with its layers split between its own
CPU and an rpc-server on another host (`--rpc HOST:PORT`, GGML_RPC), the prompt of a treeattn
run's JSON (the same token ids), greedy, the server's own timings.

Run inside the host that holds llama-server (bench/engine/dense_split.sh starts the rpc-server on
the other host and runs this in the first, both through tools/cluster). The layers are split as
llama.cpp splits them across devices: the last half of the model's repeating layers (-ngl) live
on the rpc-server with their KV cache, the rest and the output head on llama-server's CPU. The
server is bench/model/vs_llamacpp.py's (flash attention on, f16 KV cache, one slot, no prompt
cache), -t / -tb the given threads.

  llama_rpc_itl.py --llama-server BIN --model GGUF --rpc HOST:PORT --ids RUN.json
                   --steps N --threads T --json OUT
Writes OUT: {"decode_ms_p50", "prompt_ms", "steps", "ngl", "rpc", "prompt_tokens", "model"}: the
server reports one mean time per generated token (predicted_per_token_ms), taken as the p50 here;
its log in OUT.log.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "model"))
from vs_llamacpp import LlamaServer, context_override  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rpc", required=True)
    ap.add_argument("--ids", required=True, help="a treeattn generate --json whose prompt_tokens to send")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    import gguf
    r = gguf.GGUFReader(a.model)
    arch = r.fields["general.architecture"].contents()
    ngl = int(r.fields[arch + ".block_count"].contents()) // 2
    ids = json.load(open(a.ids))["prompt_tokens"]
    ctx = len(ids) + a.steps + 64
    with open(a.json + ".log", "w") as log:
        try:
            server = LlamaServer(a.llama_server, a.model, a.threads, ctx, a.threads,
                                 ["--rpc", a.rpc, "-ngl", str(ngl)] + context_override(a.model, ctx),
                                 log=log)
        except RuntimeError as e:
            sys.exit("llama_rpc_itl.py: %s (see %s.log)" % (e, a.json))
        try:
            prompt_s, per_token = server.decode(ids, a.steps)
        finally:
            server.close()
    json.dump({"decode_ms_p50": per_token[0] * 1e3, "prompt_ms": prompt_s * 1e3, "steps": a.steps,
               "ngl": ngl, "rpc": a.rpc, "prompt_tokens": len(ids), "model": os.path.basename(a.model),
               "llama_server": os.path.basename(a.llama_server)}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
