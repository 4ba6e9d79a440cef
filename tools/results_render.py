#!/usr/bin/env python3
"""Writes docs/results.md from the JSON that tools/results.sh collected (python3 stdlib only).

    python3 tools/results_render.py --work DIR --build BUILD_DIR --mode quick|full --out FILE

Each section reads one benchmark's JSON; a missing file becomes a line saying the section was
not run and why (from DIR/status.txt).
"""
import argparse
import glob
import json
import os
import platform
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(work, name):
    path = os.path.join(work, name)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def status_of(work, name):
    try:
        lines = open(os.path.join(work, "status.txt")).read().splitlines()
    except OSError:
        return "not run"
    for i, line in enumerate(lines):
        if line.split(" ", 1)[0] == name:
            rest = [l.strip() for l in lines[i + 1:] if l.startswith("    ")][:5]
            text = line.split(" ", 1)[1] if " " in line else line
            return text + ("".join("\n    " + r for r in rest) if "failed" in text else "")
    return "not run"


def fmt_us(us):
    if us is None:
        return "-"
    if us >= 1e6:
        return "%.2f s" % (us / 1e6)
    if us >= 1e3:
        return "%.1f ms" % (us / 1e3)
    return "%.0f us" % us


def fmt_bytes(b):
    if b is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= size:
            return "%.2f %s" % (b / size, unit)
    return "%d B" % b


def fmt_tokens(n):
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return "%dM" % (n >> 20)
    if n >= 1024 and n % 1024 == 0:
        return "%dk" % (n >> 10)
    return str(n)


def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, cwd=ROOT,
                              timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine(build):
    cpu, flags = "", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = ["AVX-512" if {"avx512f", "avx512bw", "avx512vl"} <= flags else
           "AVX2" if "avx2" in flags else "generic"]
    isa += [name for flag, name in (("avx512_vnni", "AVX-512 VNNI"), ("avx_vnni", "AVX-VNNI"))
            if flag in flags]
    mem = ""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                mem = "%.1f GiB" % (int(line.split()[1]) / 1048576)
    except OSError:
        pass
    compiler = ""
    try:
        for line in open(os.path.join(build, "CMakeCache.txt")):
            if line.startswith("CMAKE_CXX_COMPILER:"):
                cxx = line.split("=", 1)[1].strip()
                compiler = sh("%s --version | head -1" % cxx) or cxx
    except OSError:
        pass
    return {
        "CPU": cpu or platform.processor() or "unknown",
        "ISA": ", ".join(isa),
        "cores": str(os.cpu_count()),
        "memory": mem or "unknown",
        "compiler": compiler or "unknown",
        "MPI": sh("mpirun --version 2>&1 | head -1") or "unknown",
    }


def provenance(out):
    """The commit and time of this run, for the commit message that lands the page (the page
    itself states only what was measured, and on what). The page being written does not count
    as an uncommitted change."""
    commit = sh("git rev-parse --short HEAD") or "unknown"
    rel = os.path.relpath(os.path.abspath(out))
    spec = "" if rel.startswith("..") else " ':!%s'" % rel  # a page outside the tree: all of it
    if sh("git status --porcelain --untracked-files=no -- .%s" % spec):
        commit += " with uncommitted changes"
    return "%s, %s" % (commit, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def not_run(work, name, fallback=None):
    text = status_of(work, name)
    if text == "not run" and fallback:
        text = status_of(work, fallback)
    if text.startswith("not run: "):
        text = text[len("not run: "):]
    return "Not in this run: %s.\n" % text


def section_main(work):
    j = load(work, "main.json")
    s = "## Main job\n\n`treeattn run`: every strategy on the same shards, one step of each in turn.\n\n"
    if not j or not j.get("points"):
        return s + not_run(work, "main")
    pts = j["points"]
    p0 = pts[0]
    s += ("%d ranks, B=%d H=%d Hkv=%d D=%d, %s KV, %s tokens, %s layout.\n\n" % (
        p0["ranks"], p0["batch"], p0["heads"], p0["kv_heads"], p0["head_dim"], p0["dtype"],
        fmt_tokens(p0["seq"]), p0.get("kv_layout", "")))
    ring = next((p for p in pts if p["method"] == "ring-kv"), None)
    s += ("| method | p50 | p90 | vs ring-kv | sent/rank | peak/rank | peak RSS | KV GB/s | "
          "rel err |\n|---|---:|---:|---:|---:|---:|---:|---:|---|\n")
    for p in pts:
        l = p["latency_us"]
        vs = "%.2fx" % (ring["latency_us"]["p50"] / l["p50"]) if ring and l["p50"] else "-"
        s += "| %s | %s | %s | %s | %s | %s | %s | %.1f | %.1e %s |\n" % (
            p["method"], fmt_us(l["p50"]), fmt_us(l["p90"]), vs,
            fmt_bytes(p["bytes_sent_per_rank"]), fmt_bytes(p["peak_bytes_per_rank"]),
            fmt_bytes(p["peak_rss_bytes"]), p["kv_gbps"], p["max_rel_err"],
            "ok" if p["ok"] else "FAIL")
    return s


def section_kernel(work):
    j = load(work, "kernel.json")
    s = ("## Kernel roofline\n\n`treeattn bench --kernel`: kernel GB/s over a streaming read "
         "of the same bytes by the same threads right before it (`probe GB/s`; `frac`, median "
         "over rounds); the fastest round over that probe's fastest pass (`f_best`), with the "
         "probe's spread; over the ceiling, a loop doing only the kernel's least arithmetic (each "
         "element widened and multiplied into the rows of its group) over the same bytes, the "
         "fastest of two passes at each of four prefetch leads (`of ceiling`); and over the tighter "
         "of the bandwidth and FMA bounds (`of bound`). The CPU kernels run with this machine's "
         "kernel tuning.\n\n")
    if not j:
        return s + not_run(work, "kernel")
    s += ("| case | dtype | ISA | layout | threads | GB/s | probe GB/s | frac | f_best | probe "
          "spread | ceiling GB/s | of ceiling | bound | of bound | rel err |\n"
          "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|\n")
    for r in j:
        ceil = r.get("ceiling_gbps", 0)
        s += ("| %s | %s | %s | %s | %d | %.1f | %.1f | %.2f | %.2f | %.0f%% | %s | %s | %s | %.2f "
              "| %s |\n") % (
            r["shape"], r["dtype"], r["isa"], r["layout"], r["threads"], r["gbps"],
            r["bandwidth_gbps"], r["fraction_of_bandwidth"], r["fraction_best"],
            100 * r.get("probe_spread", 0), "%.1f" % ceil if ceil > 0 else "-",
            "%.2f" % r["fraction_of_ceiling"] if ceil > 0 else "-", r["bound"],
            r["fraction_of_bound"],
            "%.1e" % r["max_rel_error"] if r.get("max_rel_error") is not None else "-")
    return s


def section_treering(work):
    j = load(work, "treering.json")
    s = "## Tree vs ring\n\n`treeattn bench` over contexts: p50 per step and bytes sent per rank.\n\n"
    if not j or not j.get("points"):
        return s + not_run(work, "treering")
    pts = j["points"]
    seqs = sorted({p["seq"] for p in pts})
    ranks = sorted({p["ranks"] for p in pts})
    for r in ranks:
        s += "%d ranks:\n\n| method | %s | sent/rank (%s) |\n|---|%s---|\n" % (
            r, " | ".join(fmt_tokens(q) + " p50" for q in seqs), fmt_tokens(seqs[-1]),
            "---:|" * len(seqs))
        methods = []
        for p in pts:
            if p["ranks"] == r and p["method"] not in methods:
                methods.append(p["method"])
        for m in methods:
            row = {p["seq"]: p for p in pts if p["ranks"] == r and p["method"] == m}
            last = row.get(seqs[-1])
            s += "| %s | %s | %s |\n" % (m, " | ".join(
                fmt_us(row[q]["latency_us"]["p50"]) if q in row else "-" for q in seqs),
                fmt_bytes(last["bytes_sent_per_rank"]) if last else "-")
        s += "\n"
    bad = [p for p in pts if not p["ok"]]
    errs = [p["max_rel_err"] for p in pts]
    s += "%d points, %s passed the float64 check (max relative error %.1e).\n" % (
        len(pts), "all" if not bad else "%d not" % len(bad), max(errs) if errs else 0)
    return s


def section_model(work):
    s = ("## Model decode and prefill\n\n`treeattn generate --prompt-tokens N` with the default "
         "model, 1 rank, 1 thread.\n\n")
    files = sorted(glob.glob(os.path.join(work, "model_*.json")),
                   key=lambda p: int(re.sub(r"\D", "", os.path.basename(p)) or 0))
    rows = []
    for path in files:
        j = load(work, os.path.basename(path))
        if j:
            rows.append(j)
    if not rows:
        s += not_run(work, "model")
    else:
        s += ("| prompt tokens | matmul | ISA | prefill tokens/s | decode ms/token p50 | tokens/s |"
              "\n|---:|---|---|---:|---:|---:|\n")
        for j in rows:
            s += "| %d | %s | %s | %.1f | %.2f | %.1f |\n" % (
                j.get("prompt_tokens", 0) if isinstance(j.get("prompt_tokens"), int)
                else len(j.get("prompt_tokens", [])), j.get("matmul", ""), j.get("isa", ""),
                j.get("prefill_tokens_per_s", 0), j.get("decode_ms_p50", 0),
                j.get("tokens_per_s", 0))
    v = load(work, "vsllamacpp.json")
    s += "\nAgainst llama.cpp (`bench/model/vs_llamacpp.py`, same file, same threads, alternating):\n\n"
    if not v:
        return s + not_run(work, "vsllamacpp", "model")
    res = v.get("results", [])
    if res:
        keys = [k for k in res[0].keys() if not isinstance(res[0][k], (list, dict))]
        s += "| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n"
        for r in res:
            s += "| " + " | ".join(
                ("%.3g" % r[k]) if isinstance(r.get(k), float) else str(r.get(k, ""))
                for k in keys) + " |\n"
    s += "\nRead bandwidth (numpy, one thread): %.1f GB/s.\n" % v.get("bandwidth_gbs", 0)
    return s


def section_load(work):
    j = load(work, "load.json")
    s = ("## Serving load\n\n`bench/serve/loadgen.py` against `treeattn serve --ranks 2`: (a) "
         "independent prompts, (b) one document shared by many questions.\n\n")
    if not j:
        return s + not_run(work, "load", "model")
    s += ("| workload | concurrency | requests ok | generated tok/s | TTFT p50 / p99 ms | "
          "ITL p50 / p99 ms | cached tokens |\n|---|---:|---:|---:|---|---|---:|\n")
    f = lambda x: "-" if x is None else "%.0f" % x
    for r in j.get("rows", []):
        s += "| %s | %s | %s / %s | %.1f | %s / %s | %s / %s | %s |\n" % (
            r.get("workload"), r.get("concurrency"), r.get("ok"), r.get("requests"),
            r.get("tokens_per_s", 0), f(r.get("ttft_p50_ms")), f(r.get("ttft_p99_ms")),
            f(r.get("itl_p50_ms")), f(r.get("itl_p99_ms")), f(r.get("cached_tokens_mean")))
    return s


def section_merge_methods(work):
    j = load(work, "merge_methods.json")
    s = ("## Served merge by method\n\n`bench/engine/merge_methods.sh`: the serving engine's "
         "per-layer merge (`serve --method`) on emulated hosts (`tools/cluster`; `AxB` = A hosts "
         "x B ranks, `local` = one host), every method of a setting in one session. Decode "
         "inter-token latency (ITL) of one long request and of 16 concurrent ones; `x best` is "
         "against the best named method of the same setting and case.\n\n")
    if not j:
        return s + not_run(work, "merge_methods", "root")
    # Several rounds of one setting: each method's best (lowest ITL) round.
    best_of = {}
    for r in j.get("decode", []):
        k = (r["setting"], r["batch"], r["context"], r["method"])
        if k not in best_of or r["itl_ms"] < best_of[k]["itl_ms"]:
            best_of[k] = r
    rows = list(best_of.values())
    s += ("| setting | batch x context | method | merge | ITL ms | x best | engine merge+gather us/layer |"
          "\n|---|---|---|---|---:|---:|---:|\n")
    cases = {}
    for r in rows:
        cases.setdefault((r["setting"], r["batch"], r["context"]), []).append(r)
    for (st, b, c), rs in cases.items():
        named = [x["itl_ms"] for x in rs if x["method"] != "auto" and x["itl_ms"] > 0]
        best = min(named) if named else 0
        for x in rs:
            s += "| %s | %d x %s | %s | %s | %.2f | %s | %.0f |\n" % (
                st, b, fmt_tokens(c), x["method"], x["merge"], x["itl_ms"],
                "%.3f" % (x["itl_ms"] / best) if best else "-", x["merge_us_per_layer"])
    # Several rounds: each figure's lowest median.
    lowest = {}
    for x in j.get("merge_alone", []):
        k = (x["setting"], x["method"])
        if k not in lowest:
            lowest[k] = dict(x)
        else:
            for f in ("us_b1", "us_b4", "us_b16"):
                lowest[k][f] = min(lowest[k][f], x[f])
    m = list(lowest.values())
    if m:
        s += ("\nThe merge alone (`treeattn_engine_bench merge`, SmolLM2's 9 heads x 64, median "
              "us):\n\n| setting | method | merge | B=1 | B=4 | B=16 |\n|---|---|---|---:|---:|---:|\n")
        for x in m:
            s += "| %s | %s | %s | %.1f | %.1f | %.1f |\n" % (
                x["setting"], x["method"], x["merge"], x["us_b1"], x["us_b4"], x["us_b16"])
    def itl(st, b):
        for x in rows:
            if x["setting"] == st and x["batch"] == b and x["method"] == "auto":
                return x["itl_ms"]
    lines = []
    for b in sorted({r["batch"] for r in rows}):
        a, l = itl("2x2 1gbit", b), itl("1x4 local", b)
        if a and l:
            lines.append("batch %d: x%.3f" % (b, a / l))
    if lines:
        s += ("\nServing ITL with `auto` on 2 hosts x 2 ranks at 1 Gbit against 4 ranks on one "
              "host: " + ", ".join(lines) + ".\n")
    return s


def section_kv_capacity(work):
    s = ("## KV capacity\n\n`bench/engine/kv_capacity.sh`: pages on demand and quantized KV "
         "pages in the serving engine, 2 ranks.\n\n")
    c = load(work, "capacity.json")
    if not c:
        return s + not_run(work, "kv_capacity", "model")
    s += ("`treeattn serve --ranks 2 --context 32768 --kv-memory 1440M` (65,536 tokens of f16 KV "
          "per rank) and `bench/serve/capacity.py`: %d concurrent chat requests without "
          "`max_tokens`, prompts of %d-%d tokens.\n\n| requests | running at once (max) | "
          "finished | preemptions | KV used per rank (max) | seconds |\n"
          "|---:|---:|---:|---:|---|---:|\n") % (
              c["clients"], min(c["prompt_tokens"] or [0]), max(c["prompt_tokens"] or [0]))
    usage = ", ".join("%s: %.1f%%" % (r, 100 * v) for r, v in sorted(c["kv_usage_max"].items()))
    s += "| %d | %d | %d | %d | %s | %.1f |\n" % (
        c["clients"], c["running_max"], c["finished"], c["preemptions"], usage, c["seconds"])
    rows = []
    try:
        with open(os.path.join(work, "kv_dtype.log")) as f:
            for line in f:
                if line.startswith("KVDTYPE "):
                    rows.append(json.loads(line[len("KVDTYPE "):]))
    except OSError:
        pass
    if not rows:
        return s + "\n" + not_run(work, "kv_dtype", "model")
    ref = rows[0]
    s += ("\n`treeattn_engine_bench kv-dtype`: one greedy request of a %s-token prompt, 2 GiB of "
          "KV per rank, each type in a fresh engine, best of 2 rounds.\n\n| KV type | longest "
          "sequence | x %s | decode ITL ms | x %s | greedy tokens = %s | first logits: max err "
          "/ max |\n|---|---:|---:|---:|---:|---:|---:|\n") % (
              fmt_tokens(ref["context"]), ref["type"], ref["type"], ref["type"])
    for r in rows:
        s += "| %s | %s | %.3f | %.2f | %.3f | %d of %d | %.3g |\n" % (
            r["type"], "{:,}".format(r["max_sequence_tokens"]),
            r["max_sequence_tokens"] / ref["max_sequence_tokens"], r["itl_ms"],
            r["itl_ms"] / ref["itl_ms"], r["tokens_equal"], r["tokens"], r["logit_rel_err"])
    return s


def section_dense_split(work):
    s = ("## Dense split\n\n`bench/engine/dense_split.sh`: the dense layers split over the ranks "
         "(`--dense split`) against replicated and one rank, `treeattn generate --engine`, one "
         "greedy request, 1 thread per rank.\n\n")
    d = load(work, "dense_split.json")
    if not d:
        return s + not_run(work, "dense_split", "model")
    s += ("| model | matmul | prompt | ranks | dense | ITL p50 | x 1 rank | dense ms/step per rank "
          "| merge + all-gathers ms/step | tokens = 1 rank | logits = replicated |\n"
          "|---|---|---:|---:|---|---:|---:|---|---|---|---|\n")
    best = {}
    for r in d.get("itl", []):
        key = (r["model"], r["context"], r["ranks"], r["dense"])
        if key not in best or r["itl_p50_ms"] < best[key]["itl_p50_ms"]:
            best[key] = r
    for key in sorted(best, key=lambda k: (k[0], k[1], k[2], k[3] != "replicated")):
        r = best[key]
        one = best.get((key[0], key[1], 1, "replicated"))
        rep = best.get((key[0], key[1], key[2], "replicated"))
        s += "| %s | %s | %d | %d | %s | %.2f ms | %s | %s | %s | %s | %s |\n" % (
            r["model"], r["matmul"], r["context"], r["ranks"], r["dense"], r["itl_p50_ms"],
            "%.2f" % (r["itl_p50_ms"] / one["itl_p50_ms"]) if one else "-",
            " ".join("%.1f" % x for x in r.get("dense_ms", [])),
            " ".join("%.1f" % x for x in r.get("comm_ms", [])),
            ("yes" if one and r["tokens"] == one["tokens"] else "no") if one else "-",
            ("yes" if rep and r["logits_hash"] == rep["logits_hash"] else "no") if rep else "-")
    if d.get("rss"):
        s += ("\nResident weights per rank with `--dense split` (the file's pages each rank "
              "touched plus its own rows8 copy), against 1/p of the file.\n\n| model | matmul | "
              "ranks | file / p | resident per rank | max / (file / p) |\n"
              "|---|---|---:|---:|---|---:|\n")
        for r in d["rss"]:
            share = r["file_bytes"] / r["ranks"]
            res = r["weights_resident_bytes_by_rank"]
            s += "| %s | %s | %d | %s | %s | %.3f |\n" % (
                r["model"], r["matmul"] + (" (--no-rows8)" if r["matmul"] != "exact" and
                                           not r.get("rows8_bytes_rank0") else ""),
                r["ranks"], fmt_bytes(share),
                " ".join(fmt_bytes(b) for b in res), max(res) / share)
    if d.get("hosts"):
        s += ("\n2 emulated hosts x 1 rank (`tools/cluster`, `--cluster LINKS`): the same request, "
              "each link in one cluster session; auto planned on the link's preset with one rank "
              "per host, its predictions the dense part of a token (weight reads and all-gathers; "
              "the attention is the same either way). llama.cpp rows: its multi-host mode on the same two hosts "
              "(`llama-server --rpc` on host 0 with the first half of the layers and the head, "
              "`rpc-server` on host 1 with the rest, 1 thread each, the same prompt ids, flash "
              "attention, f16 KV; the ITL is the server's mean per generated token).\n\n"
              "| link | model | prompt | dense | ITL p50 | x replicated | dense ms/step per "
              "rank | merge + all-gathers ms/step | predicted split / replicated | tokens = "
              "replicated |\n|---|---|---:|---|---:|---:|---|---|---|---|\n")
        hosts = d["hosts"]
        rows = [(h, False) for h in hosts] + [(x, True) for x in d.get("llama_rpc", [])]
        rows.sort(key=lambda r: (r[0]["link"], r[0]["model"], r[0]["context"], r[1]))
        for h, llama in rows:
            rep = next((x for x in hosts if x["link"] == h["link"] and x["model"] == h["model"] and
                        x["context"] == h["context"] and x["dense_requested"] == "replicated"), None)
            if llama:
                s += "| %s | %s | %d | llama.cpp rpc (%d layers on host 1) | %.2f ms | %s | - | - | - | - |\n" % (
                    h["link"], h["model"], h["context"], h["ngl"], h["decode_ms_p50"],
                    "%.2f" % (h["decode_ms_p50"] / rep["itl_p50_ms"]) if rep else "-")
                continue
            pred = ("%s / %s" % (fmt_us(h["predicted_split_us"]), fmt_us(h["predicted_replicated_us"]))
                    if h["dense_requested"] == "auto" else "-")
            s += "| %s | %s | %d | %s%s | %.2f ms | %s | %s | %s | %s | %s |\n" % (
                h["link"], h["model"], h["context"], h["dense_requested"],
                " (%s)" % h["dense"] if h["dense_requested"] == "auto" else "", h["itl_p50_ms"],
                "%.2f" % (h["itl_p50_ms"] / rep["itl_p50_ms"]) if rep else "-",
                " ".join("%.1f" % x for x in h.get("dense_ms", [])),
                " ".join("%.1f" % x for x in h.get("comm_ms", [])), pred,
                ("yes" if h["tokens"] == rep["tokens"] else "no") if rep else "-")
    if d.get("auto"):
        s += "\n`--dense auto` at 2 ranks: "
        s += ", ".join("%s chose %s (predicted per token: split %s, replicated %s)" % (
            a["model"], a["dense"], fmt_us(a["predicted_split_us"]),
            fmt_us(a["predicted_replicated_us"])) for a in d["auto"]) + ".\n"
    return s


def section_window_pages(work):
    s = ("## Window pages\n\n`bench/engine/window_pages.sh`: Gemma-3-270M (15 of 18 layers with a "
         "512-position window), one greedy request through `treeattn generate --engine` at 2 "
         "ranks, with window pages (`--kv-window-pages -1`) and with every position kept (`0`), "
         "in one run.\n\n")
    w, a = load(work, "window.json"), load(work, "all.json")
    if not w or not a:
        return s + not_run(work, "window_pages", "model")
    mib = lambda b: "%.1f MiB" % (b / 2**20)
    s += ("| KV of the sliding-window layers | prompt | peak RSS per rank | pages per rank (full, "
          "window) | in use at most, all ranks: full pages | window pages | ITL p50 ms |\n"
          "|---|---:|---|---|---|---|---:|\n")
    for name, r in (("window pages", w), ("every position", a)):
        s += "| %s | %s | %s | %d, %d | %d (%s) | %s | %.2f |\n" % (
            name, "{:,}".format(len(r["prompt_tokens"])),
            ", ".join(mib(x) for x in r["peak_rss_bytes_by_rank"]),
            r["kv_pages_per_rank"], r["kv_window_pages_per_rank"], r["kv_pages_used_peak"],
            mib(r["kv_bytes_used_peak"]),
            "%d (%s)" % (r["kv_window_pages_used_peak"], mib(r["kv_window_bytes_used_peak"]))
            if r["kv_window_pages_per_rank"] else "-", r["decode_ms_p50"])
    s += "\nSame tokens in both runs: %s.\n" % ("yes" if w.get("tokens") == a.get("tokens") else "NO")
    return s


def section_sweep(work):
    j = load(work, "sweep.json")
    s = ("## Paper sweep (predicted)\n\n`treeattn plan --sweep`: the cost model on the paper's "
         "cluster (tree, the paper's tree recipe and ring-kv per step).\n\n")
    if not j:
        return s + not_run(work, "sweep")
    s += ("Topology `%s`.\n\n| devices | context | tree | tree-paper | ring-kv | ring-kv / tree |\n"
          "|---:|---:|---:|---:|---:|---:|\n" % j.get("topology", ""))
    for r in j.get("rows", []):
        s += "| %d | %s | %s | %s | %s | %.0fx |\n" % (
            r["devices"], fmt_tokens(r["context"]) if r["context"] % 1024 == 0 else
            "%.2fM" % (r["context"] / 1e6) if r["context"] >= 1e6 else "%dk" % (r["context"] // 1000),
            fmt_us(r["tree_us"]), fmt_us(r["tree_paper_us"]), fmt_us(r["ring_kv_us"]),
            r["speedup_vs_tree"])
    return s


def section_validate(work):
    j = load(work, "validate.json")
    s = ("## Planner validation\n\n`treeattn plan --validate`: predicted against measured p50 "
         "per strategy, and the planner's choice against the best measured.\n\n")
    if not j:
        return s + not_run(work, "validate")
    ch = j.get("choices", [])
    within = sum(1 for c in ch if c.get("within_10_percent"))
    s += "Median absolute prediction error: %.1f%%. Choice within 10%% of the best measured: %d of %d.\n\n" % (
        100 * j.get("median_abs_rel_error", 0), within, len(ch))
    if ch:
        s += ("| configuration | context | choice | its measured | best measured | best's | within 10% |"
              "\n|---|---:|---|---:|---|---:|---|\n")
        for c in ch:
            s += "| %s | %s | %s | %s | %s | %s | %s |\n" % (
                c.get("config"), fmt_tokens(c.get("seq", 0)), c.get("choice"),
                fmt_us(c.get("choice_measured_us")), c.get("best_measured"),
                fmt_us(c.get("best_measured_us")), "yes" if c.get("within_10_percent") else "no")
    return s


def section_vs_llamacpp_models(work):
    s = ("## llama.cpp by model\n\n`bench/model/vs_llamacpp_models.sh`: every shipped model in its "
         "default matmul mode against llama.cpp's llama-server as `tools/build-llama-server.sh` "
         "builds it (this CPU's ISA, AMX off) (`bench/model/vs_llamacpp.py`: the "
         "same GGUF and prompt ids, the same threads for prefill and decode, flash attention on, "
         "f16 KV, one process each, alternating; medians). Targets: prefill of 512 tokens >= 2x "
         "llama.cpp, SmolLM2 decode at 16k >= 3x. treeattn runs this CPU's best integer kernel "
         "(`int8 kernel`: `amx` on a CPU with AMX-INT8, which llama.cpp's build here leaves off; "
         "`TREEATTN_INT8_AMX=0` in the environment runs AVX-512 VNNI instead, the same bits).\n\n")
    d = load(work, "vs_llamacpp_models.json")
    if not d:
        return s + not_run(work, "vs_llamacpp_models", "model")
    s += ("| model | matmul | int8 kernel | context | threads | decode ms/token treeattn | "
          "llama.cpp | llama.cpp / treeattn | prefill tokens/s treeattn | llama.cpp | "
          "treeattn / llama.cpp |\n"
          "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    for m in d.get("models", []):
        for r in m.get("results", []):
            pt, pl = r.get("prefill_treeattn_tokens_per_s"), r.get("prefill_llamacpp_tokens_per_s")
            kernel = r.get("int8_kernel") if r["matmul"] != "exact" else None
            s += "| %s | %s | %s | %d | %d | %.2f | %.2f | %.2fx | %s | %s | %s |\n" % (
                m["name"], r["matmul"], kernel or "-", r["context"], m.get("threads", 0),
                r["treeattn_ms"],
                r["llamacpp_ms"], r["llamacpp_ms"] / r["treeattn_ms"],
                "%.0f" % pt if pt else "-", "%.0f" % pl if pl else "-",
                "%.2fx" % (pt / pl) if pt and pl else "-")
    return s


SECTIONS = {"merge_methods": section_merge_methods, "kv_capacity": section_kv_capacity,
            "dense_split": section_dense_split, "window_pages": section_window_pages,
            "vs_llamacpp_models": section_vs_llamacpp_models}


def previous_sections(path):
    """The page being replaced: its sections by heading, and the machine (CPU, ISA) it names."""
    try:
        with open(path) as f:
            old = f.read()
    except OSError:
        return {}
    cpu = re.search(r"^\| CPU \| ([^|]*) \|$", old, re.M)
    isa = re.search(r"^\| ISA \| ([^|]*) \|$", old, re.M)
    where = "measured on %s (%s)" % (cpu.group(1).strip() if cpu else "?",
                                     isa.group(1).strip() if isa else "?")
    parts = re.split(r"^(?=## )", old, flags=re.M)
    out = {}
    for k in re.finditer(r"^\| kept: ([^|]*) \| ([^|]*) \|$", old, re.M):
        out["kept " + k.group(1).strip()] = (None, k.group(2).strip())
    for part in parts:
        if part.startswith("## "):
            out[part.splitlines()[0]] = (part.rstrip("\n") + "\n", where)
    return out


def keep_previous(section, previous, kept):
    """A section this run could not measure ("Not in this run") keeps the previous page's
    figures when that page had them; the machine they were measured on goes into `kept` (the
    page's header names it)."""
    if "Not in this run:" not in section:
        return section
    head = section.splitlines()[0]
    old = previous.get(head)
    if not old or "Not in this run:" in old[0]:
        return section
    name = head[3:]
    mark = "*(kept from an earlier page:"
    if mark in old[0]:  # kept before: its first provenance stays
        first = previous.get("kept " + name)
        kept.append((name, first[1] if first else old[1]))
        return old[0]
    kept.append((name, old[1]))
    why = section[section.index("Not in this run:"):].splitlines()[0]
    body = old[0].split("\n", 1)[1]
    return "%s\n\n%s the header names its machine; %s)*\n%s" % (head, mark, why[0].lower() + why[1:],
                                                        body)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--build", help="the build the figures came from (the page's header)")
    ap.add_argument("--mode", default="full")
    ap.add_argument("--out", help="the results page to write")
    ap.add_argument("--only", choices=sorted(SECTIONS),
                    help="print this one section (no header) instead of writing the page")
    a = ap.parse_args()
    if a.only:
        sys.stdout.write(SECTIONS[a.only](a.work))
        return
    if not a.out:
        ap.error("--out is required without --only")
    m = machine(a.build)
    text = "# Results\n\n<!-- generated header: tools/results.sh writes this file; do not edit -->\n"
    text += "Generated by `tools/results.sh%s`.\n\n" % (" --quick" if a.mode == "quick" else "")
    previous = previous_sections(a.out)
    kept = []
    body = ""
    for sec in (section_main, section_kernel, section_treering, section_model,
                section_vs_llamacpp_models, section_load,
                section_merge_methods, section_kv_capacity, section_window_pages,
                section_dense_split, section_sweep, section_validate):
        body += keep_previous(sec(a.work), previous, kept) + "\n"
    for name, where in kept:
        m["kept: " + name] = where
    text += "| | |\n|---|---|\n" + "".join("| %s | %s |\n" % kv for kv in m.items())
    text += "<!-- end of generated header -->\n\n"
    text += ("Each table comes from one run of its benchmark on the machine above (a kept one: on "
             "the machine the header names for it); ratios compare "
             "sides measured in the same run. `--quick` uses small sizes: its absolute figures are "
             "not the headline sizes. How each is measured: [performance.md](performance.md).\n\n")
    text += body
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(text)
    sys.stderr.write("results_render.py: measured at %s (for the commit message)\n" % provenance(a.out))


if __name__ == "__main__":
    main()
