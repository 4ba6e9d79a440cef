#!/usr/bin/env python3
"""treeattn generate against llama.cpp on the same GGUF, prompt and threads.

llama.cpp runs as llama-cpp-python when that package imports, else as its own llama-server
(build/llama-server/bin/llama-server from tools/build-llama-server.sh, or --llama-server PATH):
one server per run, a prompt of the same ids per context, its decode time per token from the
server's own timings (predicted_per_token_ms), flash attention on, f16 KV cache.

Decode tokens/s at contexts 512, 4k, 16k and 32k (batch 1, greedy), with the limits written first:
  weight-bound   time/token >= weight bytes read per token / read bandwidth
  KV-bound       time/token >= KV bytes per step (context x layers x KV heads x head dim x 2
                 x 2 bytes in f16; a sliding-window layer reads at most its window) / read bandwidth
measured bandwidth: numpy reading a 1 GiB array (one thread).

Both run one process (treeattn: 1 rank) with the same thread count, alternately, REPEATS times;
the table shows medians. Prefill tokens/s (the whole prompt, each side's own clock) where treeattn
prefilled for real; it compares like with like only when --threads-batch is --threads (the default).
llama.cpp: flash attention on, f16 KV cache, n_batch 512; it prefills the prompt (its decode
speed needs a real cache), then 16 one-token evals are timed. treeattn: `generate --prompt-tokens
C` with the same ids (from its synthetic prompt), real prefill up to 4k (--synthetic-above),
--synthetic-kv above (decode reads the cache the same way whatever it holds), 17 new tokens (16
timed decode steps). --matmul MODE[,MODE...] (exact, int8, int8-ffn; default int8): treeattn's
quantized-weight matmul, float activations, 8-bit activations with integer dot products as
llama.cpp's, or 8-bit in the FFN and head only (generate's default for SmolLM2); with a list,
each repeat runs every mode and then llama.cpp once, and the table has a row per mode.

  python3 bench/model/vs_llamacpp.py [--threads 1] [--contexts 512,4096,16384,32768] [--repeats 3]
      [--synthetic-above 4096] [--threads-batch T]   (llama-server's prefill threads; its decode: --threads)
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


def run_treeattn(b, model, ctx, threads, new_tokens, engine=False, matmul="int8", synthetic_above=4096,
                 isa="auto"):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [b, "generate", "--model", model, "--prompt-tokens", str(ctx), "--new-tokens",
           str(new_tokens), "--ignore-eos", "--quiet", "--threads", str(threads), "--json", out,
           "--matmul", matmul, "--isa", isa]
    if not engine:
        cmd += ["--session", "--timeout-ms", "0"]
        if ctx > synthetic_above:
            cmd.append("--synthetic-kv")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    j = json.load(open(out))
    os.unlink(out)
    return j


class LlamaServer:
    """llama.cpp's llama-server on 127.0.0.1 for one model (its output into `log`, a file, when
    given)."""

    def __init__(self, path, model, threads, ctx, threads_batch, extra=(), log=None):
        import socket
        with socket.socket() as so:
            so.bind(("127.0.0.1", 0))
            self.port = so.getsockname()[1]
        out = log if log is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [path, "-m", model, "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
             "-tb", str(threads_batch), "-c", str(ctx), "-np", "1", "-fa", "on", "-b", "512", *extra],
            stdout=out, stderr=subprocess.STDOUT if log is not None else subprocess.DEVNULL)
        import urllib.request
        for _ in range(600):
            if self.proc.poll() is not None:
                raise RuntimeError("llama-server exited %d" % self.proc.returncode)
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/health" % self.port, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("llama-server did not start")

    def decode(self, ids, steps):
        import urllib.error
        import urllib.request
        body = {"prompt": ids, "n_predict": steps, "temperature": 0, "top_k": 1,
                "cache_prompt": False, "ignore_eos": True}
        req = urllib.request.Request("http://127.0.0.1:%d/completion" % self.port,
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=3600) as r:
                t = json.loads(r.read())["timings"]
        except urllib.error.HTTPError as e:
            raise RuntimeError("llama-server refused %d prompt tokens: %s" % (len(ids), e.read().decode()))
        return t["prompt_ms"] / 1e3, [t["predicted_per_token_ms"] / 1e3] * steps

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def model_bytes(model):
    """Weight bytes one decoded token reads, a function giving the f16 KV bytes one decode step
    reads at a context (sliding-window layers read at most their window), and the architecture."""
    import gguf
    r = gguf.GGUFReader(model)
    arch = r.fields["general.architecture"].contents()
    f = lambda k, d=None: r.fields[arch + "." + k].contents() if arch + "." + k in r.fields else d
    layers, heads = int(f("block_count")), int(f("attention.head_count"))
    kv = int(f("attention.head_count_kv", heads))
    hd = int(f("attention.key_length", int(f("embedding_length")) // heads))
    names = {t.name: t for t in r.tensors}
    w = sum(int(t.n_bytes) for n, t in names.items() if n != "token_embd.weight")
    emb = names["token_embd.weight"]
    w += int(emb.n_bytes) // int(emb.shape[1])  # one embedding row
    if "output.weight" not in names:
        w += int(emb.n_bytes)  # tied head
    per_layer = kv * hd * 2 * 2  # K and V, f16
    window = f("attention.sliding_window")
    if arch == "gemma3" and window:  # one global layer in six (llama.cpp's and treeattn's rule)
        glob = layers // 6
        return float(w), lambda ctx: per_layer * (glob * ctx + (layers - glob) * min(ctx, int(window))), arch
    return float(w), lambda ctx: per_layer * layers * ctx, arch


def train_context(model):
    import gguf
    r = gguf.GGUFReader(model)
    arch = r.fields["general.architecture"].contents()
    key = arch + ".context_length"
    return arch, int(r.fields[key].contents()) if key in r.fields else 0


def context_override(model, ctx):
    """llama-server caps its cache at the trained context (SmolLM2: 8192); decode speed does not
    depend on that number, so a longer benchmark context raises it."""
    arch, trained = train_context(model)
    return (["--override-kv", "%s.context_length=int:%d" % (arch, ctx)]
            if trained and ctx > trained else [])


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
    ap.add_argument("--llama-server", default=os.path.join(ROOT, "build/llama-server/bin/llama-server"),
                    help="used when llama_cpp (llama-cpp-python) does not import")
    ap.add_argument("--engine", action="store_true",
                    help="treeattn's engine path (real prefill at every context) instead of --session")
    ap.add_argument("--synthetic-above", type=int, default=4096,
                    help="without --engine: contexts above this fill treeattn's cache with --synthetic-kv")
    ap.add_argument("--threads-batch", type=int, default=0,
                    help="llama-server's prefill threads (-tb; default --threads); decode uses --threads")
    ap.add_argument("--matmul", default="int8",
                    help="treeattn's quantized-weight matmul (generate --matmul): exact, int8, "
                         "int8-ffn, or a comma list of them")
    ap.add_argument("--isa", default="auto",
                    help="treeattn's kernel target (generate --isa: auto, avx512, avx2, generic); "
                         "pair avx2 with --llama-server build/llama-server-avxvnni/bin/llama-server "
                         "(tools/build-llama-server.sh --isa avxvnni) on a CPU with AVX-VNNI")
    a = ap.parse_args()
    a.modes = a.matmul.split(",")
    for m in a.modes:
        if m not in ("exact", "int8", "int8-ffn"):
            ap.error("--matmul %s: each mode is exact, int8 or int8-ffn" % m)
    steps = 16
    bw = bandwidth_gbs()
    weight_bytes, kv_bytes, arch = model_bytes(a.model)
    contexts = [int(c) for c in a.contexts.split(",")]
    try:
        import llama_cpp  # noqa: F401
        use_server = False
        which = "llama-cpp-python"
    except ImportError:
        use_server = True
        which = "%s (one per context, -c context + %d)" % (os.path.relpath(a.llama_server, ROOT),
                                                          steps + 64)
    print("# treeattn (matmul %s, isa %s) vs llama.cpp (%s), %s (%s), %d thread(s), load %s" % (
        a.matmul, a.isa, which, os.path.basename(a.model), arch, a.threads,
        open("/proc/loadavg").read().split()[:3]))
    print("# read bandwidth (numpy, 1 thread): %.1f GB/s; weights %.0f MB/token; KV %d B per "
          "cached token at 16k (f16)" % (bw, weight_bytes / 1e6, kv_bytes(16384) // 16384))
    print("| context | matmul | limit ms/token (weights + KV at %.1f GB/s) | limit tokens/s "
          "| treeattn tokens/s | llama.cpp tokens/s | treeattn / llama.cpp | treeattn ms/token "
          "| llama.cpp ms/token | prefill treeattn tokens/s | prefill llama.cpp tokens/s "
          "| prefill treeattn / llama.cpp |" % bw)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    results = []
    measure(a, contexts, steps, bw, weight_bytes, kv_bytes, use_server, results)
    if a.json:
        json.dump({"threads": a.threads, "matmul": a.matmul, "isa": a.isa, "bandwidth_gbs": bw, "results": results},
                  open(a.json, "w"), indent=2)


def measure(a, contexts, steps, bw, weight_bytes, kv_bytes, use_server, results):
    for ctx in contexts:
        # a cache sized for this context: llama.cpp's attention reads the cells it has, rounded up
        extra = context_override(a.model, ctx + steps + 64) if use_server else []
        server = (LlamaServer(a.llama_server, a.model, a.threads, ctx + steps + 64,
                              a.threads_batch or a.threads, extra) if use_server else None)
        try:
            measure_context(a, ctx, steps, bw, weight_bytes, kv_bytes, server, results)
        finally:
            if server is not None:
                server.close()


def measure_context(a, ctx, steps, bw, weight_bytes, kv_bytes, server, results):
    limit_ms = (weight_bytes + kv_bytes(ctx)) / (bw * 1e9) * 1e3
    ta = {m: [] for m in a.modes}
    tp = {m: [] for m in a.modes}
    kernel = {}  # the integer kernel generate ran per mode (its --json int8_kernel)
    lc, lp = [], []
    real_prefill = a.engine or ctx <= a.synthetic_above
    for _ in range(a.repeats):
        for m in a.modes:
            j = run_treeattn(a.treeattn, a.model, ctx, a.threads, steps + 1, a.engine, m,
                             a.synthetic_above, a.isa)
            ta[m].append(statistics.median(j["decode_ms"] if a.engine else j["methods"][0]["decode_ms"]))
            kernel[m] = j.get("int8_kernel", "")
            if real_prefill:  # prefill speed: the whole prompt, each side's own clock
                tp[m].append(j["prefill_tokens_per_s"])
        if server is not None:
            prompt_s, times = server.decode(j["prompt_tokens"], steps)
        else:
            prompt_s, times = run_llamacpp(a.model, j["prompt_tokens"], a.threads, steps)
        lc.append(statistics.median(times) * 1e3)
        if real_prefill:
            lp.append(ctx / prompt_s)
    l_ms = statistics.median(lc)
    for m in a.modes:
        t_ms = statistics.median(ta[m])
        r = {"context": ctx, "matmul": m, "limit_ms": limit_ms, "treeattn_ms": t_ms,
             "llamacpp_ms": l_ms, "treeattn_runs_ms": ta[m], "llamacpp_runs_ms": lc,
             "int8_kernel": kernel[m]}
        pf = "| - | - | - |"
        if tp[m]:
            r.update({"prefill_treeattn_tokens_per_s": statistics.median(tp[m]),
                      "prefill_llamacpp_tokens_per_s": statistics.median(lp),
                      "prefill_llamacpp_threads": a.threads_batch or a.threads})
            pf = "| %.0f | %.0f | %.2fx |" % (
                r["prefill_treeattn_tokens_per_s"], r["prefill_llamacpp_tokens_per_s"],
                r["prefill_treeattn_tokens_per_s"] / r["prefill_llamacpp_tokens_per_s"])
        results.append(r)
        label = m + (" (%s)" % kernel[m] if kernel[m] and m != "exact" else "")  # int8 modes
        print("| %d | %s | %.1f | %.0f | %.1f | %.1f | %.2fx | %.1f | %.1f %s" % (
            ctx, label, limit_ms, 1e3 / limit_ms, 1e3 / t_ms, 1e3 / l_ms, l_ms / t_ms, t_ms, l_ms, pf))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
