#!/usr/bin/env python3
"""Load generator for OpenAI-compatible servers: `treeattn serve`, llama.cpp's llama-server, vLLM.

Streams /v1/completions requests (prompts as token ids, so every server sees exactly the same
tokens; "ignore_eos" so every request generates exactly max_tokens) from N concurrent clients
and reports, per workload and concurrency:
  generated tokens/s   all requests' generated tokens / wall time of the workload
  TTFT p50 / p99       request sent -> first streamed text (ms)
  ITL  p50 / p99       between consecutive streamed text chunks of a request (ms)
  prompt tokens/s      prompt tokens / wall time (cached ones included)
Workloads:
  a   independent prompts of --prompt-tokens (512) random tokens, --max-tokens (128) out, at each
      concurrency of --concurrency (1,4,16); --requests-per-client (2) requests per client
  b   one document of --doc-tokens (8000) random tokens shared by --questions (32) requests,
      each with its own --question-tokens (30) question, --b-max-tokens (32) out, all at once
      (--b-concurrency, default: all); the shared prefix is what a prefix cache can reuse
With several --target NAME=URL the workloads run against each in turn, in one run, and the
table gives each target's ratio to the first (throughput: higher is better; TTFT: lower).

Limits first (--bandwidth-gbs B --gflops G, e.g. from `treeattn bench --kernel` and a matmul
probe): when the first target is `treeattn serve`, its /v1/models tells the bytes of weights a
token reads, the KV bytes per token and the flops per token, and each row gets the bound
  prefill  >= prompt tokens computed x (matmul flops + attention flops at their positions) / G
  decode   >= per step (weights once + KV of the live sequences) / B, for max_tokens steps
  bound    = generated tokens / (prefill + decode)   (compute and memory not overlapped: a
             lower bound on time, so an upper bound on tokens/s within a factor of 2)
Workload b's bound counts the document once (a prefix cache computes it once).

Usage:
  bench/serve/loadgen.py --target treeattn=http://127.0.0.1:8080 \\
                         --target llama=http://127.0.0.1:8081 [--workload a,b] [--json out.json]

Only the Python standard library is needed. Token ids are drawn (seeded) from --vocab-range
(default 1000-40000: ordinary BPE tokens of SmolLM2's 49,152-token vocabulary); pass the range
of another model's vocabulary for other models.
"""
import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
import urllib.parse


def percentile(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = max(0, min(len(xs) - 1, int(round(q * (len(xs) - 1)))))
    return xs[k]


class Target:
    def __init__(self, name, url, api_key, model):
        self.name = name
        u = urllib.parse.urlparse(url if "://" in url else "http://" + url)
        self.host, self.port = u.hostname, u.port or 80
        self.prefix = u.path.rstrip("/")
        if not self.prefix.endswith("/v1"):
            self.prefix += "/v1"
        self.api_key = api_key
        self.model = model

    def stream(self, body, timeout):
        """One streamed completion. Returns dict(ok, ttft, itls, tokens, prompt_tokens,
        cached, error)."""
        body = dict(body, stream=True, stream_options={"include_usage": True})
        if self.model:
            body["model"] = self.model
        data = json.dumps(body)
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = "Bearer " + self.api_key
        out = {"ok": False, "ttft": None, "itls": [], "tokens": 0, "chunks": 0,
               "prompt_tokens": None, "cached": None, "error": None}
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        t0 = time.perf_counter()
        try:
            conn.request("POST", self.prefix + "/completions", body=data, headers=headers)
            resp = conn.getresponse()
            if resp.status != 200:
                out["error"] = "HTTP %d: %s" % (resp.status, resp.read()[:200].decode("replace"))
                return out
            last = None
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    out["ok"] = True
                    break
                j = json.loads(payload)
                if "error" in j:
                    out["error"] = str(j["error"])[:200]
                    break
                now = time.perf_counter()
                if j.get("choices"):
                    text = j["choices"][0].get("text") or ""
                    if text:
                        out["chunks"] += 1
                        if out["ttft"] is None:
                            out["ttft"] = now - t0
                        else:
                            out["itls"].append(now - last)
                        last = now
                u = j.get("usage")
                if u:
                    out["tokens"] = u.get("completion_tokens", 0)
                    out["prompt_tokens"] = u.get("prompt_tokens")
                    d = u.get("prompt_tokens_details") or {}
                    out["cached"] = d.get("cached_tokens")
            if not out["ok"] and out["error"] is None:
                out["error"] = "the stream ended without data: [DONE]"
            if out["ok"] and not out["tokens"]:
                out["tokens"] = out["chunks"]  # no usage chunk: one token per chunk
        except Exception as e:  # noqa: BLE001
            out["error"] = repr(e)
        finally:
            out["total"] = time.perf_counter() - t0
            conn.close()
        return out


def run_requests(target, bodies, concurrency, timeout):
    """Sends bodies from `concurrency` clients; returns (results, wall seconds)."""
    results = [None] * len(bodies)
    lock = threading.Lock()
    nxt = [0]

    def client():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(bodies):
                return
            results[i] = target.stream(bodies[i], timeout)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(min(concurrency, len(bodies)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def summarize(results, wall, prompt_tokens):
    good = [r for r in results if r and r["ok"]]
    errors = [r["error"] for r in results if r and not r["ok"]]
    ttfts = [r["ttft"] * 1e3 for r in good if r["ttft"] is not None]
    itls = [x * 1e3 for r in good for x in r["itls"]]
    gen = sum(r["tokens"] for r in good)
    cached = [r["cached"] for r in good if r["cached"] is not None]
    return {
        "requests": len(results), "ok": len(good), "errors": errors[:3],
        "wall_s": wall, "generated_tokens": gen,
        "tokens_per_s": gen / wall if wall > 0 else 0.0,
        "prompt_tokens_per_s": prompt_tokens * len(good) / wall if wall > 0 else 0.0,
        "ttft_p50_ms": percentile(ttfts, 0.5), "ttft_p99_ms": percentile(ttfts, 0.99),
        "itl_p50_ms": percentile(itls, 0.5), "itl_p99_ms": percentile(itls, 0.99),
        "cached_tokens_mean": statistics.mean(cached) if cached else None,
    }


def fetch_meta(target):
    try:
        conn = http.client.HTTPConnection(target.host, target.port, timeout=30)
        headers = {"Authorization": "Bearer " + target.api_key} if target.api_key else {}
        conn.request("GET", target.prefix + "/models", headers=headers)
        j = json.loads(conn.getresponse().read())
        return j["data"][0].get("meta") or {}
    except Exception:  # noqa: BLE001
        return {}


def bound_tokens_per_s(args, meta, n, prompt_computed, positions, steps, live, context):
    """Upper bound on generated tokens/s (see the head comment); None without the facts."""
    need = ("weight_bytes_per_token", "kv_bytes_per_token", "matmul_flops_per_token",
            "attention_flops_per_token_per_position")
    if not (args.bandwidth_gbs and args.gflops and all(k in meta for k in need)):
        return None
    flops = prompt_computed * meta["matmul_flops_per_token"] + \
        positions * meta["attention_flops_per_token_per_position"]
    prefill = flops / (args.gflops * 1e9)
    rounds = -(-n // live)
    step_bytes = meta["weight_bytes_per_token"] + live * context * meta["kv_bytes_per_token"]
    decode = rounds * steps * step_bytes / (args.bandwidth_gbs * 1e9)
    return n * steps / (prefill + decode)


def tokens(rng, n, lo, hi):
    return [rng.randrange(lo, hi) for _ in range(n)]


def workload_a(args, target, rng_seed):
    rows = []
    for c in args.concurrency:
        rng = random.Random(rng_seed * 1000 + c)
        n = max(1, c * args.requests_per_client)
        bodies = [{"prompt": tokens(rng, args.prompt_tokens, *args.vocab_range),
                   "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
                  for _ in range(n)]
        res, wall = run_requests(target, bodies, c, args.timeout)
        s = summarize(res, wall, args.prompt_tokens)
        P, M = args.prompt_tokens, args.max_tokens
        s["bound_tokens_per_s"] = bound_tokens_per_s(args, args.meta, n, n * P,
                                                      n * P * P / 2, M, c, P + M / 2)
        s.update(workload="a", concurrency=c, target=target.name)
        rows.append(s)
        print_row(s)
    return rows


def workload_b(args, target, rng_seed):
    rng = random.Random(rng_seed * 7919)
    doc = tokens(rng, args.doc_tokens, *args.vocab_range)
    bodies = [{"prompt": doc + tokens(rng, args.question_tokens, *args.vocab_range),
               "max_tokens": args.b_max_tokens, "temperature": 0, "ignore_eos": True}
              for _ in range(args.questions)]
    c = args.b_concurrency or len(bodies)
    if args.b_warm:  # the document computed once before the measured requests
        target.stream(dict(bodies[0], prompt=doc + tokens(rng, args.question_tokens,
                                                          *args.vocab_range)), args.timeout)
    res, wall = run_requests(target, bodies, c, args.timeout)
    s = summarize(res, wall, args.doc_tokens + args.question_tokens)
    D, Q, M, n = args.doc_tokens, args.question_tokens, args.b_max_tokens, len(bodies)
    s["bound_tokens_per_s"] = bound_tokens_per_s(
        args, args.meta, n, D + n * Q, D * D / 2 + n * Q * (D + Q / 2), M, min(c, n),
        D + Q + M / 2)
    s.update(workload="b", concurrency=c, target=target.name)
    print_row(s)
    return [s]


HEADER = ("| target | workload | conc. | ok | generated tok/s | bound tok/s | TTFT p50 ms | "
          "TTFT p99 ms | ITL p50 ms | ITL p99 ms | cached/req |")


def print_row(s):
    cached = "-" if s["cached_tokens_mean"] is None else "%.0f" % s["cached_tokens_mean"]
    bound = "-" if s.get("bound_tokens_per_s") is None else "%.0f" % s["bound_tokens_per_s"]
    print("| %s | %s | %d | %d/%d | %.1f | %s | %.0f | %.0f | %.1f | %.1f | %s |" % (
        s["target"], s["workload"], s["concurrency"], s["ok"], s["requests"], s["tokens_per_s"],
        bound, s["ttft_p50_ms"], s["ttft_p99_ms"], s["itl_p50_ms"], s["itl_p99_ms"], cached),
        flush=True)
    for e in s["errors"]:
        print("    error: %s" % e, file=sys.stderr)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", action="append", required=True,
                   help="NAME=URL (the server's base URL, with or without /v1); repeatable")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="the model field sent (default: none)")
    p.add_argument("--workload", default="a,b", help="a, b or a,b")
    p.add_argument("--concurrency", default="1,4,16",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--doc-tokens", type=int, default=8000)
    p.add_argument("--questions", type=int, default=32)
    p.add_argument("--question-tokens", type=int, default=30)
    p.add_argument("--b-max-tokens", type=int, default=32)
    p.add_argument("--b-concurrency", type=int, default=0, help="0: all questions at once")
    p.add_argument("--vocab-range", default="1000-40000",
                   type=lambda s: tuple(int(x) for x in s.split("-")))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--warmup", type=int, default=1, help="requests sent first (not measured)")
    p.add_argument("--json", default=None, help="write every row here")
    p.add_argument("--bandwidth-gbs", type=float, default=0,
                   help="memory bandwidth of the server's machine (GB/s), for the bound")
    p.add_argument("--gflops", type=float, default=0,
                   help="matmul GFLOP/s of the server's machine, for the bound")
    p.add_argument("--b-warm", action="store_true",
                   help="workload b: send the first question alone first (a warm prefix cache)")
    args = p.parse_args()
    targets = []
    for t in args.target:
        name, _, url = t.partition("=")
        if not url:
            name, url = url or t, t
        targets.append(Target(name, url, args.api_key, args.model))
    workloads = args.workload.split(",")
    args.meta = fetch_meta(targets[0])
    rows = []
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    for t in targets:
        for _ in range(args.warmup):
            r = t.stream({"prompt": [1000, 1001, 1002], "max_tokens": 2, "temperature": 0},
                         args.timeout)
            if not r["ok"]:
                print("%s: warm-up failed: %s" % (t.name, r["error"]), file=sys.stderr)
                return 1
        for w in workloads:
            rows += (workload_a if w == "a" else workload_b)(args, t, args.seed)
    if len(targets) > 1:
        print("\n%s against each other target: throughput = its tokens/s over theirs (> 1: %s "
              "is faster); TTFT p99 = theirs over its (> 1: %s answers sooner)" %
              (targets[0].name, targets[0].name, targets[0].name))
        base = {(r["workload"], r["concurrency"]): r for r in rows if r["target"] == targets[0].name}
        for r in rows:
            b = base.get((r["workload"], r["concurrency"]))
            if r["target"] == targets[0].name or not b:
                continue
            failed = [(x["target"], x["requests"] - x["ok"], x["requests"]) for x in (b, r)
                      if x["ok"] < x["requests"]]
            if failed:
                print("  workload %s, concurrency %d: not comparable (%s)" % (
                    r["workload"], r["concurrency"], ", ".join(
                        "%s: %d of %d requests failed" % f for f in failed)))
                continue
            print("  %s / %s, workload %s, concurrency %d: throughput %.2fx, TTFT p99 %.2fx" % (
                targets[0].name, r["target"], r["workload"], r["concurrency"],
                b["tokens_per_s"] / r["tokens_per_s"] if r["tokens_per_s"] else float("inf"),
                r["ttft_p99_ms"] / b["ttft_p99_ms"] if b["ttft_p99_ms"] else float("nan")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
