#!/usr/bin/env python3
"""Joins the GPU check's parts into OUTDIR/gpu-check.json and prints the short table.

Inputs: OUTDIR/gpu-check-core.json (gpu_check), OUTDIR/sdpa.json (sdpa_peer.py, optional) and the
build time in seconds (argument). The targets of the GPU issue are evaluated and shown, but only
wrong results (gpu_check's verdict) fail the run.
"""
import json
import os
import sys


def main(outdir, build_seconds):
    with open(os.path.join(outdir, "gpu-check-core.json")) as f:
        core = json.load(f)
    sdpa = {"available": False, "reason": "sdpa_peer.py did not run"}
    path = os.path.join(outdir, "sdpa.json")
    if os.path.exists(path):
        with open(path) as f:
            sdpa = json.load(f)
    peer = {(r["batch"], r["tokens"]): r for r in sdpa.get("shapes", [])}
    copy = core.get("probes", {}).get("copy_gbps") or 0
    print(f"\n{'batch':>5} {'tokens':>8} {'KV GiB':>7} {'ms':>8} {'GB/s':>7} {'of copy':>8} "
          f"{'merge us':>9} {'sdpa ms':>8} {'sdpa GB/s':>10} {'vs sdpa':>8}")
    for row in core.get("bandwidth", []):
        p = peer.get((row["batch"], row["tokens"]), {})
        row["sdpa_gbps"] = p.get("gbps")
        row["sdpa_error"] = p.get("error")
        row["speedup_vs_sdpa"] = (row["gbps"] / p["gbps"]) if p.get("gbps") else None
        sp = f"{row['speedup_vs_sdpa']:.2f}x" if row["speedup_vs_sdpa"] else "-"
        sg = f"{p['gbps']:.0f}" if p.get("gbps") else "-"
        sm = f"{p['ms']:.3f}" if p.get("ms") else "-"
        best = [t for t in (row.get("graph_ms"), row.get("eager_ms")) if t]
        print(f"{row['batch']:>5} {row['tokens']:>8} {row['kv_bytes'] / 2**30:>7.2f} "
              f"{(min(best) if best else 0):>8.3f} "
              f"{(row['gbps'] or 0):>7.0f} {100 * (row['fraction_of_copy'] or 0):>7.0f}% "
              f"{(row.get('fused_merge_us') or 0):>9.1f} {sm:>8} {sg:>10} {sp:>8}")
    targets = []
    long_b1 = [r for r in core.get("bandwidth", []) if r["batch"] == 1 and r["tokens"] >= 262144]
    if long_b1 and copy:
        worst = min(r["fraction_of_copy"] or 0 for r in long_b1)
        targets.append({"target": "kernel >= 85% of copy bandwidth at >= 256k tokens, bf16, batch 1",
                        "met": worst >= 0.85, "value": worst})
    faster = [r["speedup_vs_sdpa"] for r in core.get("bandwidth", []) if r.get("speedup_vs_sdpa")]
    if faster:
        targets.append({"target": "faster than PyTorch SDPA on the same shapes",
                        "met": min(faster) > 1.0, "value": min(faster)})
    merges = [v.get("merge_graph_us") or v.get("merge_us") for v in core.get("virtual_ranks", [])
              if v["p"] >= 2]
    if merges:
        targets.append({"target": "merge of P partial states < 10 us (llama3-8b, batch 1)",
                        "met": max(merges) < 10, "value": max(merges)})
    fused = [r["fused_merge_us"] for r in core.get("bandwidth", []) if r.get("fused_merge_us")]
    if fused:
        targets.append({"target": "split merge fused into the decode kernel < 10 us (its cost "
                                  "over the unmerged splits)",
                        "met": max(fused) < 10, "value": max(fused)})
    for t in targets:
        print(f"target {'met' if t['met'] else 'NOT met'}: {t['target']} ({t['value']:.3g})")
    # The gpu-labelled tests, run by gpu-check.sh through minitest (gpu-tests-NAME.json).
    tests = {}
    for name in ("test_cuda_executor", "test_nccl_comm"):
        tpath = os.path.join(outdir, f"gpu-tests-{name}.json")
        if not os.path.exists(tpath):
            tests[name] = {"ran": False}
            print(f"gpu tests: {name} wrote no results (crashed, timed out or not built)")
            continue
        with open(tpath) as f:
            t = json.load(f)
        tests[name] = t
        print(f"gpu tests: {name}: {t['passed']} passed, {t['failed']} failed, "
              f"{t['skipped']} skipped")
        for r in t["tests"]:
            if r["result"] != "passed":
                first = (r["message"].strip().splitlines() or [""])[-1]
                print(f"  {r['result']:7} {r['name']}: {first[:150]}")
    core["gpu_tests"] = tests
    core["sdpa_peer"] = sdpa
    core["targets"] = targets
    core["build_seconds"] = build_seconds
    with open(os.path.join(outdir, "gpu-check.json"), "w") as f:
        json.dump(core, f, indent=2)
    checks = core.get("checks", [])
    bad = [c for c in checks if not c["ok"] and not c.get("environment")]
    env = [c for c in checks if not c["ok"] and c.get("environment")]
    done = "" if core.get("complete", True) else " (gpu_check did not finish: later sections missing)"
    print(f"\n{len(checks)} checks, {len(bad)} wrong, {len(env)} set-up failures{done}; "
          f"written {os.path.join(outdir, 'gpu-check.json')}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: report.py OUTDIR BUILD_SECONDS")
    main(sys.argv[1], float(sys.argv[2]))
