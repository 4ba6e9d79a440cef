#!/usr/bin/env python3
"""Joins the GPU check's parts into OUTDIR/gpu-check.json and prints the short table.

Inputs: OUTDIR/gpu-check-runs.tsv (gpu-check.sh: what it built and ran, how each ended),
OUTDIR/gpu-check-SECTION.json (gpu_check --section, one process each; or gpu-check-core.json of
a plain gpu_check run), OUTDIR/gpu-tests-NAME.json (minitest), OUTDIR/sdpa.json (sdpa_peer.py,
optional) and the build time in seconds (argument). A section that crashed, timed out or never
ran and a target that did not build become failed checks of their own, so every verdict shows.
The targets of the GPU issue are evaluated and shown, but only wrong results fail the run.
"""
import json
import os
import sys

SECTIONS = ("widening", "correctness", "bandwidth", "bandwidth8", "nccl")
TESTS = ("test_cuda_executor", "test_nccl_comm")


def read_runs(outdir):
    """gpu-check-runs.tsv as a list of (kind, name, status, detail)."""
    path = os.path.join(outdir, "gpu-check-runs.tsv")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return [tuple((line.rstrip("\n").split("\t") + ["", "", "", ""])[:4]) for line in f
                if line.strip()]


def check(section, name, detail, environment=False):
    return {"section": section, "name": name, "ok": False, "environment": environment,
            "error": 0, "detail": detail}


def merge_sections(outdir, runs):
    """One core report from the sections' files, with a failed check for every section that
    did not end with a verdict and for every target that did not build."""
    core = {"tool": "gpu_check", "complete": True, "device": {}, "checks": [],
            "probes": {"copy_gbps": 0, "read_gbps": 0}, "bandwidth": [], "virtual_ranks": [],
            "notes": []}
    for kind, name, status, detail in runs:
        if kind == "build" and status != "ok":
            core["checks"].append(check("build", name, f"did not compile (log: {detail})"))
    built = any(k == "build" and n == "gpu_check" and st == "ok" for k, n, st, _ in runs)
    ended = {n: st for k, n, st, _ in runs if k == "section"}
    no_gpu = False
    for s in SECTIONS:
        path = os.path.join(outdir, f"gpu-check-{s}.json")
        part = None
        if os.path.exists(path):
            with open(path) as f:
                part = json.load(f)
            core["device"] = core["device"] or part.get("device", {})
            core["checks"] += part.get("checks", [])
            core["notes"] += part.get("notes", [])
            # bf16 rows, their probes and the virtual ranks from "bandwidth"; the fp8 / int8 rows
            # and their own probes from "bandwidth8".
            core["bandwidth"] += part.get("bandwidth", []) if s.startswith("bandwidth") else []
            if s == "bandwidth":
                for key in ("probes", "virtual_ranks"):
                    core[key] = part.get(key, core[key])
            if s == "bandwidth8":
                core["probes_8bit"] = part.get("probes", {})
            no_gpu = no_gpu or any(c["section"] == "device" and not c["ok"]
                                   for c in part.get("checks", []))
        status = ended.get(s)
        if status is None:
            why = ("not run: gpu_check did not build" if not built
                   else "not run: no usable GPU" if no_gpu else "not run")
            core["checks"].append(check(s, f"gpu_check --section {s}", why, environment=no_gpu))
            core["complete"] = False
        elif status not in ("0", "1", "2"):
            how = (f"timed out (exit {status})" if status in ("124", "137")
                   else f"crashed (exit {status})")
            done = "" if part is None else "; the checks above are those it finished"
            core["checks"].append(check(s, f"gpu_check --section {s}", how + done))
            core["complete"] = False
        elif part is None or not part.get("complete", False):
            core["checks"].append(check(s, f"gpu_check --section {s}",
                                        f"exit {status} without its results file"))
            core["complete"] = False
    return core


def main(outdir, build_seconds):
    runs = read_runs(outdir)
    if runs is None:
        with open(os.path.join(outdir, "gpu-check-core.json")) as f:
            core = json.load(f)
    else:
        core = merge_sections(outdir, runs)
        with open(os.path.join(outdir, "gpu-check-core.json"), "w") as f:
            json.dump(core, f, indent=2)
    sdpa = {"available": False, "reason": "sdpa_peer.py did not run"}
    path = os.path.join(outdir, "sdpa.json")
    if os.path.exists(path):
        with open(path) as f:
            sdpa = json.load(f)
    peer = {(r["batch"], r["tokens"]): r for r in sdpa.get("shapes", [])}
    copy = core.get("probes", {}).get("copy_gbps") or 0
    rows = core.get("bandwidth", [])
    for row in rows:
        row.setdefault("dtype", "bf16")
    if rows:
        print(f"\n{'dtype':>5} {'batch':>5} {'tokens':>8} {'KV GiB':>7} {'ms':>8} {'GB/s':>7} "
              f"{'of copy':>8} {'merge us':>9} {'sdpa ms':>8} {'sdpa GB/s':>10} {'vs sdpa':>8}")
    for row in rows:
        # PyTorch SDPA runs the bf16 cache: only bf16 rows are compared with it.
        p = peer.get((row["batch"], row["tokens"]), {}) if row["dtype"] == "bf16" else {}
        row["sdpa_gbps"] = p.get("gbps")
        row["sdpa_error"] = p.get("error")
        row["speedup_vs_sdpa"] = (row["gbps"] / p["gbps"]) if p.get("gbps") else None
        sp = f"{row['speedup_vs_sdpa']:.2f}x" if row["speedup_vs_sdpa"] else "-"
        sg = f"{p['gbps']:.0f}" if p.get("gbps") else "-"
        sm = f"{p['ms']:.3f}" if p.get("ms") else "-"
        mg = f"{row['fused_merge_us']:.1f}" if row.get("fused_merge_us") else "-"
        best = [t for t in (row.get("graph_ms"), row.get("eager_ms")) if t]
        print(f"{row['dtype']:>5} {row['batch']:>5} {row['tokens']:>8} "
              f"{row['kv_bytes'] / 2**30:>7.2f} "
              f"{(min(best) if best else 0):>8.3f} "
              f"{(row['gbps'] or 0):>7.0f} {100 * (row['fraction_of_copy'] or 0):>7.0f}% "
              f"{mg:>9} {sm:>8} {sg:>10} {sp:>8}")
    # The fraction of copy bandwidth of every dtype side by side, one line a shape.
    shapes = sorted({(r["batch"], r["tokens"]) for r in rows})
    for batch, tokens in shapes:
        fracs = ", ".join(f"{r['dtype']} {100 * (r['fraction_of_copy'] or 0):.0f}%"
                          for r in rows if (r["batch"], r["tokens"]) == (batch, tokens))
        print(f"of copy bandwidth, batch {batch}, {tokens} tokens: {fracs}")
    p8 = core.get("probes_8bit", {}).get("copy_gbps")
    if p8 and copy:
        print(f"copy probes: {copy:.0f} GB/s (bf16 section), {p8:.0f} GB/s (8-bit section)")
    targets = []
    long_b1 = [r for r in rows
               if r["dtype"] == "bf16" and r["batch"] == 1 and r["tokens"] >= 262144]
    if long_b1 and copy:
        worst = min(r["fraction_of_copy"] or 0 for r in long_b1)
        targets.append({"target": "kernel >= 85% of copy bandwidth at >= 256k tokens, bf16, batch 1",
                        "met": worst >= 0.85, "value": worst})
    faster = [r["speedup_vs_sdpa"] for r in rows if r.get("speedup_vs_sdpa")]
    if faster:
        targets.append({"target": "faster than PyTorch SDPA on the same shapes",
                        "met": min(faster) > 1.0, "value": min(faster)})
    merges = [v.get("merge_graph_us") or v.get("merge_us") for v in core.get("virtual_ranks", [])
              if v["p"] >= 2]
    if merges:
        targets.append({"target": "merge of P partial states < 10 us (llama3-8b, batch 1)",
                        "met": max(merges) < 10, "value": max(merges)})
    fused = [r["fused_merge_us"] for r in rows if r.get("fused_merge_us")]
    if fused:
        targets.append({"target": "split merge fused into the decode kernel < 10 us (its cost "
                                  "over the unmerged splits)",
                        "met": max(fused) < 10, "value": max(fused)})
    for t in targets:
        print(f"target {'met' if t['met'] else 'NOT met'}: {t['target']} ({t['value']:.3g})")
    # The gpu-labelled tests, run by gpu-check.sh through minitest (gpu-tests-NAME.json).
    tests = {}
    failed_tests = 0
    for name in TESTS:
        tpath = os.path.join(outdir, f"gpu-tests-{name}.json")
        if not os.path.exists(tpath):
            tests[name] = {"ran": False}
            failed_tests += 1
            print(f"gpu tests: {name} wrote no results (crashed, timed out or not built)")
            continue
        with open(tpath) as f:
            t = json.load(f)
        tests[name] = t
        failed_tests += t["failed"] + t.get("not_run", 0)
        done = "" if t.get("complete", True) else " (the run ended early)"
        print(f"gpu tests: {name}: {t['passed']} passed, {t['failed']} failed, "
              f"{t['skipped']} skipped, {t.get('not_run', 0)} not run{done}")
        for r in t["tests"]:
            if r["result"] != "passed":
                first = (r["message"].strip().splitlines() or [""])[-1]
                print(f"  {r['result']:7} {r['name']}: {first[:150]}")
    nccl = next((st for k, _, st, _ in (runs or []) if k == "nccl"), None)
    if nccl is not None:
        core["nccl"] = nccl
        print(f"NCCL: {nccl}")
    core["gpu_tests"] = tests
    core["sdpa_peer"] = sdpa
    core["targets"] = targets
    core["build_seconds"] = build_seconds
    with open(os.path.join(outdir, "gpu-check.json"), "w") as f:
        json.dump(core, f, indent=2)
    checks = core.get("checks", [])
    bad = [c for c in checks if not c["ok"] and not c.get("environment")]
    env = [c for c in checks if not c["ok"] and c.get("environment")]
    for c in bad + env:
        print(f"{'FAIL' if c in bad else 'ENV ':4} {c['section']}: {c['name']}: {c['detail'][:200]}")
    done = "" if core.get("complete", True) else " (gpu_check did not finish every section)"
    print(f"\n{len(checks)} checks, {len(bad)} wrong, {len(env)} set-up failures{done}; "
          f"{failed_tests} GPU tests failed or not run; "
          f"written {os.path.join(outdir, 'gpu-check.json')}")
    return 1 if bad or failed_tests else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: report.py OUTDIR BUILD_SECONDS")
    sys.exit(main(sys.argv[1], float(sys.argv[2])))
