#!/usr/bin/env python3
"""treeattn generate against llama.cpp (llama-cpp-python) on the same GGUF, prompt and threads.

Decode tokens/s at contexts 512, 4k, 16k and 32k (batch 1, greedy), with the limits written first:
  weight-bound   time/token >= weight bytes read per token / read bandwidth
  KV-bound       time/token >= KV bytes per token (context x 30 layers x 3 KV heads x 64 x 2
                 x 2 bytes in f16) / read bandwidth
measured bandwidth: numpy reading a 1 GiB array (one thread).

Both run one process (treeattn: 1 rank) with the same thread count, alternately, REPEATS times;
the table shows medians. llama.cpp: flash attention on, f16 KV cache, n_batch 512; it prefills
the prompt (its decode speed needs a real cache), then 16 one-token evals are timed. treeattn:
`generate --prompt-tokens C` with the same ids (from its synthetic prompt), real prefill up to
4k, --synthetic-kv above (decode reads the cache the same way whatever it holds), 17 new tokens
(16 timed decode steps).

  python3 bench/model/vs_llamacpp.py [--threads 1] [--contexts 512,4096,16384,32768] [--repeats 3]
Not part of the test suite.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bandwidth_gbs():
    a = np.ones(256 * 1024 * 1024, dtype=np.float32)  # 1 GiB
    a.sum()
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        a.sum()
        best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def run_treeattn(b, model, ctx, threads, new_tokens):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [b, "generate", "--session", "--model", model, "--prompt-tokens", str(ctx), "--new-tokens",
           str(new_tokens), "--ignore-eos", "--quiet", "--threads", str(threads), "--json", out,
           "--timeout-ms", "0"]
    if ctx > 4096:
        cmd.append("--synthetic-kv")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    j = json.load(open(out))
    os.unlink(out)
    return j


def run_llamacpp(model, ids, threads, steps):
    from llama_cpp import Llama
    m = Llama(model_path=model, n_ctx=len(ids) + steps + 16, n_threads=threads,
              n_threads_batch=threads, flash_attn=True, n_batch=512, verbose=False)
    t0 = time.perf_counter()
    m.eval(ids)
    prefill = time.perf_counter() - t0
    times = []
    for i in range(steps):  # which token is fed does not change the work
        t = time.perf_counter()
        m.eval([ids[i]])
        times.append(time.perf_counter() - t)
    del m
    return prefill, times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--treeattn", default=os.path.join(ROOT, "build/release/cli/treeattn"))
    ap.add_argument("--model", default=subprocess.run([os.path.join(ROOT, "tools/model-path.sh")],
                                                       capture_output=True, text=True).stdout.strip())
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--contexts", default="512,4096,16384,32768")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    steps = 16
    bw = bandwidth_gbs()
    weight_bytes = 92.0e6  # LlamaModel::weight_bytes_per_token for SmolLM2 (test_llama_real)
    kv_per_token = 30 * 3 * 64 * 2 * 2
    print("# treeattn vs llama.cpp (llama-cpp-python), SmolLM2-135M-Instruct Q4_1, %d thread(s), "
          "load %s" % (a.threads, open("/proc/loadavg").read().split()[:3]))
    print("# read bandwidth (numpy, 1 thread): %.1f GB/s; weights %.0f MB/token; KV %d B per "
          "cached token (f16)" % (bw, weight_bytes / 1e6, kv_per_token))
    print("| context | limit ms/token (weights + KV at %.1f GB/s) | limit tokens/s | treeattn tokens/s "
          "| llama.cpp tokens/s | treeattn / llama.cpp | treeattn ms/token | llama.cpp ms/token |" % bw)
    print("|---|---|---|---|---|---|---|---|")
    results = []
    for ctx in [int(c) for c in a.contexts.split(",")]:
        limit_ms = (weight_bytes + ctx * kv_per_token) / (bw * 1e9) * 1e3
        ta, lc = [], []
        for _ in range(a.repeats):
            j = run_treeattn(a.treeattn, a.model, ctx, a.threads, steps + 1)
            ta.append(statistics.median(j["methods"][0]["decode_ms"]))
            _, times = run_llamacpp(a.model, j["prompt_tokens"], a.threads, steps)
            lc.append(statistics.median(times) * 1e3)
        t_ms, l_ms = statistics.median(ta), statistics.median(lc)
        results.append({"context": ctx, "limit_ms": limit_ms, "treeattn_ms": t_ms, "llamacpp_ms": l_ms,
                        "treeattn_runs_ms": ta, "llamacpp_runs_ms": lc})
        print("| %d | %.1f | %.0f | %.1f | %.1f | %.2fx | %.1f | %.1f |" % (
            ctx, limit_ms, 1e3 / limit_ms, 1e3 / t_ms, 1e3 / l_ms, l_ms / t_ms, t_ms, l_ms))
        sys.stdout.flush()
    if a.json:
        json.dump({"threads": a.threads, "bandwidth_gbs": bw, "results": results}, open(a.json, "w"), indent=2)


if __name__ == "__main__":
    main()
