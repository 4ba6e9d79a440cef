#!/usr/bin/env bash
# Tests of `treeattn plan` and `treeattn topo` (and the --cluster / --methods auto flags of
# bench): argument and file errors exit 2 with a message naming the problem; the planner's
# choice and the JSON outputs; topo --detect under mpirun; bench on a 2x2 emulated cluster.
# Usage: plan_cli_test.sh /path/to/treeattn CASE
set -u
bin=$1
case_name=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
py=/usr/bin/python3

# expect_fail CODE PATTERN -- command...: exit code and a message in the output.
expect_fail() {
  local code=$1 pattern=$2
  shift 3
  local out rc
  out=$(timeout 120 "$@" 2>&1)
  rc=$?
  if [ "$rc" != "$code" ]; then
    echo "expected exit $code, got $rc from: $*"; echo "$out"; exit 1
  fi
  if ! grep -qE -- "$pattern" <<<"$out"; then
    echo "expected /$pattern/ in the output of: $*"; echo "$out"; exit 1
  fi
}

# run_ok command...: exit 0, output shown on failure.
run_ok() {
  local out rc
  out=$(timeout 280 "$@" 2>&1)
  rc=$?
  if [ "$rc" != 0 ]; then echo "expected exit 0, got $rc from: $*"; echo "$out"; exit 1; fi
}

case "$case_name" in
  plan_errors)
    printf '{"format": ' >"$tmp/t.json"
    expect_fail 2 "t.json: not valid JSON: parse error at line 1" -- "$bin" plan --topology "$tmp/t.json"
    expect_fail 2 "cannot open topology file|No such file|does not exist" -- "$bin" plan --topology "$tmp/missing.json"
    expect_fail 2 "unknown topology preset 'nope' \(known: dgx-h100x16" -- "$bin" plan --topology preset:nope
    expect_fail 2 "ranks must be in \[1, 2\] for topology 'local'.*got 9" -- "$bin" plan --topology preset:local --ranks 9
    expect_fail 2 "--methods: unknown strategy 'foo' \(known: tree" -- "$bin" plan --methods tree,foo
    expect_fail 2 "--fanout must be >= 1, got 0" -- "$bin" plan --fanout 0
    expect_fail 2 "heads \(6\) must be a multiple of kv_heads \(4\)" -- "$bin" plan --heads 6 --kv-heads 4
    expect_fail 2 "give at most one of --sweep, --validate" -- "$bin" plan --sweep --validate
    expect_fail 2 "--cluster: expected KxR" -- "$bin" plan --validate --cluster 2by2 ;;
  plan_choice)
    # 128 H100s, paper block, 1M tokens: a tree variant wins and the KV ring comes last.
    run_ok "$bin" plan --topology preset:dgx-h100x16 --ranks 128 --preset paper-block --seq 1M \
      --json "$tmp/p.json"
    "$py" - "$tmp/p.json" <<'PY' || exit 1
import json, sys
j = json.load(open(sys.argv[1]))
p = j["plans"][0]
names = [s["strategy"] for s in p["strategies"]]
assert p["choice"] == names[0], p["choice"]
assert p["choice"] in ("tree", "tree2", "hier", "tree-paper"), p["choice"]
assert names[-1] == "ring-kv", names
lat = [s["latency_us"] for s in p["strategies"]]
assert lat == sorted(lat), lat
for s in p["strategies"]:
    for k in ("latency_us", "bytes_sent_per_rank", "peak_bytes_per_rank", "algorithm"):
        assert k in s, k
PY
    # A slow shared network with 8 ranks per node: hier (one state per node crosses it).
    cat >"$tmp/slow.json" <<'JSON'
{"format": "treeattn-topology/1", "name": "slow-net", "nodes": 4, "ranks_per_node": 8,
 "memory": {"bandwidth_GBps": 30},
 "levels": [{"name": "node", "latency_us": 0.5, "bandwidth_GBps": 10},
            {"name": "network", "latency_us": 20, "bandwidth_GBps": 0.1, "links_per_node": 1}]}
JSON
    out=$(timeout 60 "$bin" plan --topology "$tmp/slow.json" --preset paper-block --seq 320000) || { echo "$out"; exit 1; }
    grep -q "^choice: hier" <<<"$out" || { echo "expected hier on a slow shared network"; echo "$out"; exit 1; } ;;
  plan_sweep)
    run_ok "$bin" plan --sweep --json "$tmp/s.json" --plot "$tmp/s.png"
    "$py" - "$tmp/s.json" "$tmp/s.png" <<'PY' || exit 1
import json, sys
j = json.load(open(sys.argv[1]))
rows = j["rows"]
assert len(rows) == 21, len(rows)  # 3 device counts x 7 contexts
assert {r["devices"] for r in rows} == {8, 64, 128}
at = [r for r in rows if r["devices"] == 128 and r["context"] == 5120000][0]
assert at["speedup_vs_tree_paper"] > 8, at  # the model's ratio is far above the paper's ~8x
assert all(r["ring_kv_us"] > r["tree_us"] for r in rows)
assert open(sys.argv[2], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
PY
    ;;
  topo_show)
    run_ok "$bin" topo --show preset:dgx-h100x16
    run_ok "$bin" topo --list
    printf '{"format": "treeattn-topology/1", "name": "x", "nodes": 1, "ranks_per_node": 2, "memory": {"bandwidth_GBps": 1}, "levels": [{"name": "node", "latency_us": 1, "bandwith_GBps": 2}]}' >"$tmp/typo.json"
    expect_fail 2 "typo.json: \\\$.levels\[0\].bandwith_GBps: unknown key" -- "$bin" topo --show "$tmp/typo.json"
    expect_fail 2 "give exactly one of --detect, --show" -- "$bin" topo
    expect_fail 2 "--link 1gbit needs --cluster KxR" -- "$bin" topo --detect --link 1gbit
    expect_fail 2 "--nodes 5 must be between 0" -- "$bin" topo --detect --ranks 2 --nodes 5 ;;
  bench_cluster_errors)
    expect_fail 2 "--cluster: expected KxR .* got '3'" -- "$bin" bench --cluster 3
    expect_fail 2 "--link 1gbit needs --cluster KxR" -- "$bin" bench --link 1gbit
    expect_fail 2 "--link: expected a tc rate" -- "$bin" bench --cluster 2x2 --link fast
    expect_fail 2 "--link 1gbit needs at least 2 emulated hosts" -- "$bin" bench --cluster 1x4 --link 1gbit
    expect_fail 2 "--cluster 2x2 places 4 ranks .* --ranks 3" -- "$bin" bench --cluster 2x2 --ranks 3 --seq 4k
    expect_fail 2 "unknown method 'foo' .*auto \(the planner's choice\)" -- "$bin" bench --methods auto,foo ;;
  topo_detect)
    run_ok "$bin" topo --detect --ranks 2 --out "$tmp/d.json" --probe-mib 32 --kernel-tokens 2048 \
      --latency-iters 20
    run_ok "$bin" topo --show "$tmp/d.json"
    "$py" - "$tmp/d.json" <<'PY' || exit 1
import json, sys
t = json.load(open(sys.argv[1]))
assert t["format"] == "treeattn-topology/1"
assert t["nodes"] == 1 and t["ranks_per_node"] == 2, t
assert t["levels"][0]["latency_us"] > 0 and t["levels"][0]["bandwidth_GBps"] > 0
assert t["memory"]["bandwidth_GBps"] > 0
assert any("decode kernel" in s for s in t["sources"]), t["sources"]
PY
    # --nodes 2 makes the two ranks two nodes: a network level appears.
    run_ok "$bin" topo --detect --ranks 2 --nodes 2 --out "$tmp/d2.json" --probe-mib 32 \
      --kernel-tokens 2048 --latency-iters 20
    "$py" -c "import json,sys; t=json.load(open(sys.argv[1])); assert t['nodes']==2 and len(t['levels'])==2, t" "$tmp/d2.json" || exit 1 ;;
  bench_auto)
    run_ok "$bin" plan --topology preset:local --ranks 2 --seq 8k --json "$tmp/p.json"
    run_ok "$bin" bench --ranks 2 --seq 8k --methods auto --warmup 0 --iters 2 --json "$tmp/b.json"
    "$py" - "$tmp/p.json" "$tmp/b.json" <<'PY' || exit 1
import json, sys
choice = json.load(open(sys.argv[1]))["plans"][0]["choice"]
pts = json.load(open(sys.argv[2]))["points"]
assert [p["method"] for p in pts] == [choice], ([p["method"] for p in pts], choice)
assert pts[0]["max_rel_err"] <= 1e-5
PY
    ;;
  cluster_bench)
    # 2 emulated hosts x 2 ranks: every listed method and auto exact across hosts.
    run_ok "$bin" bench --cluster 2x2 --seq 8k --methods tree,hier,ring-kv,allgather,auto \
      --warmup 1 --iters 2 --json "$tmp/c.json"
    "$py" - "$tmp/c.json" <<'PY' || exit 1
import json, sys
pts = json.load(open(sys.argv[1]))["points"]
assert len(pts) >= 4, pts
for p in pts:
    assert p["ranks"] == 4, p
    assert p["max_rel_err"] <= 1e-5, (p["method"], p["max_rel_err"])
# bytes really crossed TCP between the hosts for the KV ring
ring = [p for p in pts if p["method"] == "ring-kv"][0]
assert ring["bytes_sent_per_rank"] > 1e6, ring
PY
    ;;
  *) echo "unknown case $case_name"; exit 2 ;;
esac
echo "ok: $case_name"
