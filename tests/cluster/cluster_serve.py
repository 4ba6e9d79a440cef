#!/usr/bin/env python3
"""`treeattn serve` across emulated hosts, with the official `openai` client (run by
cluster_serve_test.sh with the venv of tools/serve-venv.sh, as root).

Usage: cluster_serve.py TREEATTN MODEL CASE

Every case runs `treeattn serve` as 4 ranks on 2 emulated hosts x 2 slots joined by a 1 Gbit
shaped link (tools/cluster/cluster.sh session: mpirun inside host treeattn-h0, ranks 0-1 there,
ranks 2-3 on treeattn-h1), rank 0 listening on its cluster address 10.213.0.1. The client runs
inside treeattn-h0 (cluster.sh exec), this script re-run there with --inside. The session always
takes the hosts down; each case then checks that nothing is left behind (no namespace, no
process of the job).

Cases:
  exact         a 1-rank server (here, on 127.0.0.1) gives the reference; then 8 concurrent
                clients against the cluster (2 completions and 2 chats, each streamed and not):
                greedy token ids equal the 1-rank ones token for token (and the streamed text the
                non-streamed), /health 200, timings name 4 ranks; SIGUSR1 to mpirun drains: exit 0
  long_prefill  --timeout-ms 1500 --prefill-chunk 4096: one ~2600-token prompt prefilled in one
                step far longer than the timeout: /health stays 200 throughout (no false alarm:
                collectives wait only for the imbalance between ranks), the tokens equal 1 rank's;
                then idle for three timeouts (the heartbeat step): /health stays 200, and a
                request after it is answered
  link_down     --timeout-ms 20000: with a stream and a non-streamed request in flight, host
                treeattn-h1's link goes down (`ip link set eth0 down` in its namespace): /health
                answers 503 within the progress watchdog's limit (the default of
                `serve --stall-timeout-ms`) + 2 s, long before the collective timeout, both
                requests end with an error (never a hang), the job exits 3
  stopped       the same with host treeattn-h1's two ranks SIGSTOPped
"""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CLUSTER = os.path.join(ROOT, "tools", "cluster", "cluster.sh")
H0, H1 = "treeattn-h0", "treeattn-h1"
ADDR = "10.213.0.1"  # host 0 in cluster.sh's default subnet
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy
T0 = time.monotonic()
WHERE = ""  # " h0" in the client run inside host treeattn-h0 (its own clock)


def log(*a):
    print("[%5.1f s%s]" % (time.monotonic() - T0, WHERE), *a, flush=True)


def check(cond, what, dump=None):
    if not cond:
        if dump:
            dump()
        raise SystemExit("FAIL: " + what)
    log("ok:", what)


def get(url, path, timeout=5):
    """(status, body); status 0 when no answer came (refused, reset, timed out)."""
    try:
        with OPENER.open(url + path, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (OSError, urllib.error.URLError) as e:
        return 0, repr(e)


def client(url, timeout=120):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout)


PROMPTS = ["The capital of France is", "Once upon a time, in a small village,"]
QUESTIONS = ["What is 2 + 2?", "Say hello in French."]
N_TOKENS = 24
# About 2600 tokens: 208 numbered items.
LONG_PROMPT = " ".join("Item %d of the list is the %s %s." % (i, c, a) for i, (c, a) in enumerate(
    [(c, a) for a in ("apple", "river", "stone", "cloud", "lamp", "horse", "glass", "tree")
     for c in ("red", "blue", "green", "yellow", "black", "white", "small", "large", "old",
               "new", "bright", "dark", "warm", "cold", "quiet", "loud", "soft", "hard", "round",
               "flat", "tall", "short", "heavy", "light", "fast", "slow")]))
LONG_TIMEOUT_MS = 1500
FAULT_TIMEOUT_MS = 20000  # link_down, stopped: the collective timeout, well past the watchdog


def ask(c, kind, text, n, stream):
    """(prompt token ids, generated token ids, text) of one greedy request."""
    kw = dict(model="any", max_tokens=n, temperature=0, extra_body={"return_token_ids": True})
    if kind == "chat":
        kw["messages"] = [{"role": "user", "content": text}]
        create = c.chat.completions.create
    else:
        kw["prompt"] = text
        create = c.completions.create
    if not stream:
        r = create(**kw)
        ch = r.choices[0]
        out = ch.message.content if kind == "chat" else ch.text
        return r.model_extra["prompt_token_ids"], ch.model_extra["token_ids"], out, \
            r.model_extra.get("timings")
    parts, ids, prompt_ids = [], None, None
    for chunk in create(stream=True, **kw):
        if chunk.model_extra.get("prompt_token_ids") is not None:
            prompt_ids = chunk.model_extra["prompt_token_ids"]
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        parts.append((ch.delta.content if kind == "chat" else ch.text) or "")
        if ch.model_extra.get("token_ids") is not None:
            ids = ch.model_extra["token_ids"]
    return prompt_ids, ids, "".join(parts), None


# ---- inside host treeattn-h0 -------------------------------------------------------------------

def rank_pids(host):
    """Pids of the MPI ranks (not the daemon) in one emulated host's namespace."""
    out = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True).stdout
    pids = []
    for p in out.split():
        try:
            env = open("/proc/%s/environ" % p, "rb").read().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(b"OMPI_COMM_WORLD_RANK=") for e in env):
            pids.append(int(p))
    return pids


def inside_exact(url, p):
    code, body = get(url, "/health")
    check(code == 200, "/health 200 at %s: %s" % (url, body))
    c = client(url)
    check(c.models.list().data[0].id == os.path.basename(p["model"]), "/v1/models")
    results = {}

    def run(i, kind, text, stream):
        try:
            results[(i, stream)] = ask(c, kind, text, N_TOKENS, stream)
        except Exception as e:  # noqa: BLE001
            results[(i, stream)] = e

    threads = [threading.Thread(target=run, args=(i, kind, text, stream))
               for i, (kind, text, _, _, _) in enumerate(p["jobs"]) for stream in (False, True)]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    log("%d concurrent clients across 2 hosts: %.1f s" % (len(threads), time.monotonic() - t0))
    check(not any(th.is_alive() for th in threads), "every client returned")
    for i, (kind, text, want_prompt, want, want_text) in enumerate(p["jobs"]):
        for stream in (False, True):
            got = results[(i, stream)]
            what = "%s %r (%s)" % (kind, text, "streamed" if stream else "not streamed")
            check(isinstance(got, tuple), what + " answered: %s" % (got if not isinstance(
                got, tuple) else "ok"))
            if not stream:
                check(got[3] is not None and got[3]["ranks"] == 4, what + ": timings name 4 "
                      "ranks (%s)" % got[3])
                check(got[0] == want_prompt, what + ": the 1-rank prompt tokens")
            check(got[1] == want, what + ": %d tokens == 1 rank's token for token" % len(want))
            check(got[2] == want_text, what + ": the 1-rank text %r" % got[2])


def inside_long_prefill(url, p):
    c = client(url, timeout=600)
    health, done = [], threading.Event()

    def poll():
        while not done.is_set():
            health.append(get(url, "/health", timeout=10)[0])
            time.sleep(0.1)

    th = threading.Thread(target=poll)
    th.start()
    t0 = time.monotonic()
    try:
        got = ask(c, "completion", LONG_PROMPT, 8, False)
    finally:
        done.set()
        th.join()
    took = time.monotonic() - t0
    prefill_s = got[3]["prefill_ms"] / 1000
    # 7-15 s on 2 shared cores; the communicator's own limit is 1 s (collective_timeout).
    check(prefill_s > p["timeout_s"], "a %d-token prompt prefilled in one step for %.1f s, "
          "longer than the %.1f s timeout" % (len(got[0]), prefill_s, p["timeout_s"]))
    check(len(health) > 5 and all(s == 200 for s in health),
          "/health 200 all along (%d polls over %.1f s): %s" % (
              len(health), took, sorted(set(health))))
    check(got[0] == p["prompt_ids"] and got[1] == p["tokens"],
          "the long prompt's tokens == 1 rank's %s" % p["tokens"])
    # Idle for three timeouts: the ranks other than 0 wait for the next step all along, and the
    # heartbeat (an empty step every 250 ms) keeps each wait short.
    idle = 3 * p["timeout_s"]
    t0, codes = time.monotonic(), []
    while time.monotonic() - t0 < idle:
        codes.append(get(url, "/health")[0])
        time.sleep(0.1)
    again = ask(c, "completion", PROMPTS[0], 4, False)
    check(all(s == 200 for s in codes) and len(again[1]) == 4,
          "idle for %.1f s (3 timeouts): /health 200 all along (%s), then a request answered" % (
              idle, sorted(set(codes))))


def inside_fault(url, p):
    fault, limit = p["case"], p["stall_s"] + 2
    code, body = get(url, "/health")
    check(code == 200, "/health 200 before the fault: %s" % body)
    c = client(url, timeout=p["timeout_s"] + 60)
    result, flowing = {}, threading.Event()

    def streamed():
        try:
            n = 0
            for _ in c.completions.create(model="any", prompt=PROMPTS[0], max_tokens=4000,
                                          temperature=0, stream=True,
                                          extra_body={"ignore_eos": True}):
                n += 1
                if n == 4:
                    flowing.set()
            result["streamed"] = "ended normally after %d chunks" % n
        except openai.APITimeoutError as e:
            result["streamed"] = "hung: " + repr(e)
        except openai.APIError as e:
            result["streamed"] = "APIError: " + e.message
        except Exception as e:  # noqa: BLE001
            result["streamed"] = "error: " + repr(e)
        result["streamed_at"] = time.monotonic()
        flowing.set()

    def whole():
        try:
            c.completions.create(model="any", prompt=PROMPTS[1], max_tokens=4000, temperature=0,
                                 extra_body={"ignore_eos": True})
            result["whole"] = "answered"
        except openai.APITimeoutError as e:
            result["whole"] = "hung: " + repr(e)
        except openai.APIStatusError as e:
            result["whole"] = "HTTP %d: %s" % (e.status_code, e.message)
        except Exception as e:  # noqa: BLE001
            result["whole"] = "error: " + repr(e)
        result["whole_at"] = time.monotonic()

    threads = [threading.Thread(target=f) for f in (streamed, whole)]
    for th in threads:
        th.start()
    check(flowing.wait(120) and "streamed" not in result, "tokens flow in the stream")
    time.sleep(0.3)
    if fault == "link_down":
        cmd = [CLUSTER, "exec", H1, "--", "ip", "link", "set", "eth0", "down"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        check(r.returncode == 0, "host %s: `ip link set eth0 down` (%s)" % (H1, r.stderr.strip()))
    else:
        pids = rank_pids(H1)
        check(len(pids) == 2, "host %s runs 2 ranks: %s" % (H1, pids))
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        log("SIGSTOP to %s" % pids)
    t_fault = time.monotonic()
    seen = []
    while time.monotonic() - t_fault < limit + 5:
        code, body = get(url, "/health", timeout=2)
        seen.append(code)
        if code == 503:
            break
        time.sleep(0.05)
    t_503 = time.monotonic() - t_fault
    check(code == 503, "/health answered 503 (after %.2f s; before: %s): %s" % (
        t_503, sorted(set(seen[:-1])), body))
    check(t_503 <= limit, "/health 503 %.2f s after the fault, within the progress watchdog's "
          "limit + 2 s (%.0f s; the collective timeout is %.0f s)" % (t_503, limit, p["timeout_s"]))
    for th in threads:
        th.join(p["timeout_s"] + 90)
    check(not any(th.is_alive() for th in threads), "both clients returned: %s" % result)
    check(result["streamed"].startswith("APIError") and "engine failed" in result["streamed"],
          "the stream in flight ended with an error event %.1f s after the fault: %s" % (
              result["streamed_at"] - t_fault, result["streamed"]))
    check(result["whole"].startswith("HTTP 503"),
          "the non-streamed request in flight: %.1f s after the fault, %s" % (
              result["whole_at"] - t_fault, result["whole"]))


# ---- the driver (root namespace) ---------------------------------------------------------------

def serve_default_s(flag):
    """The default of a `serve` milliseconds flag, from the help, in seconds."""
    h = subprocess.run([TREEATTN, "serve", "--help"], capture_output=True, text=True).stdout
    m = re.search(re.escape(flag) + r"\s+INT\s*(?:=|\[)(\d+)", h)
    check(m is not None, "serve --help names the %s default" % flag)
    return int(m.group(1)) / 1000


class Job:
    """A process whose stderr (and stdout) is kept, echoed on failure, with the address it
    prints."""

    def __init__(self, cmd, env=None):
        log("$", " ".join(cmd))
        self.lines, self.url, self.ready = [], None, threading.Event()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, errors="replace", env=env)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            m = re.search(r"listening on (http://\S+)", line)
            if m and self.url is None:
                self.url = m.group(1)
                self.ready.set()
        self.ready.set()

    def wait_ready(self, timeout):
        if not self.ready.wait(timeout) or self.url is None:
            self.dump()
            raise SystemExit("FAIL: the server did not print its address")
        log("server at", self.url)

    def dump(self):
        log("---- server output ----")
        for line in self.lines:
            log("  " + line)


def reference(jobs, long_prompt):
    """Greedy tokens of 1 rank (here, on 127.0.0.1) for the same prompts."""
    s = Job([TREEATTN, "serve", "--model", MODEL, "--port", "0", "--kv-memory", "256M"])
    try:
        s.wait_ready(180)
        c = client(s.url)
        out = []
        for kind, text in jobs:
            prompt, tokens, txt, _ = ask(c, kind, text, N_TOKENS, False)
            out.append((kind, text, prompt, tokens, txt))
        long_ref = ask(c, "completion", LONG_PROMPT, 8, False) if long_prompt else None
        log("1-rank reference: %d requests" % len(out))
    finally:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
        rc = s.proc.wait(60)
    check(rc == 0, "the 1-rank server exit %d" % rc, s.dump)
    return out, long_ref


def our_processes():
    """Processes of the cluster job still alive anywhere: the serve ranks (their --host is the
    cluster address), mpirun / orted / the rsh agent (their command lines name the hosts)."""
    left = []
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == os.getpid():
            continue
        try:
            cmd = open("/proc/%s/cmdline" % p, "rb").read().replace(b"\0", b" ").decode(
                errors="replace")
        except OSError:
            continue
        if (ADDR in cmd and "serve" in cmd) or H0 in cmd or H1 in cmd:
            left.append("%s: %s" % (p, cmd[:160]))
    return left


def our_namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines()
            if re.match(r"treeattn-(h\d+|br)\b", line)]


def mpirun_pid():
    out = subprocess.run(["ip", "netns", "pids", H0], capture_output=True, text=True).stdout
    for p in out.split():
        try:
            if open("/proc/%s/comm" % p).read().strip() == "mpirun":
                return int(p)
        except OSError:
            pass
    return None


def driver():
    timeout_s = serve_default_s("--timeout-ms")
    log("serve timeout (default of --timeout-ms): %.1f s" % timeout_s)
    params = {"case": CASE, "model": MODEL, "timeout_s": timeout_s,
              "stall_s": serve_default_s("--stall-timeout-ms")}
    extra = []
    if CASE == "exact":
        distinct = [("completion", t) for t in PROMPTS] + [("chat", q) for q in QUESTIONS]
        params["jobs"], _ = reference(distinct, False)
    elif CASE == "long_prefill":
        _, long_ref = reference([], True)
        params["prompt_ids"], params["tokens"] = long_ref[0], long_ref[1]
        params["timeout_s"] = LONG_TIMEOUT_MS / 1000
        extra = ["--timeout-ms", str(LONG_TIMEOUT_MS), "--prefill-chunk", "4096"]
    elif CASE in ("link_down", "stopped"):
        params["timeout_s"] = FAULT_TIMEOUT_MS / 1000  # far beyond the watchdog's limit
        extra = ["--timeout-ms", str(FAULT_TIMEOUT_MS)]
    else:
        raise SystemExit("unknown case " + CASE)

    check(not our_namespaces(), "no emulated cluster before the test")
    cmd = [CLUSTER, "session", "2", "--slots", "2", "--link", "1gbit", "--", "-np", "4",
           TREEATTN, "serve", "--model", MODEL, "--host", ADDR, "--port", "0", "--threads", "1",
           "--kv-memory", "256M", "--shutdown-timeout", "30"] + extra
    job = Job(cmd, env=dict(os.environ, TREEATTN_CLUSTER_TIMEOUT="300"))
    ok = False
    try:
        job.wait_ready(400)  # the session may wait for another one's lock first
        check(job.url.startswith("http://%s:" % ADDR), "rank 0 listens on its cluster address")
        inside = [CLUSTER, "exec", H0, "--", sys.executable, os.path.abspath(__file__),
                  "--inside", CASE, job.url, json.dumps(params)]
        r = subprocess.run(inside, timeout=600)
        check(r.returncode == 0, "the client inside %s passed (exit %d)" % (H0, r.returncode),
              job.dump)
        if CASE in ("exact", "long_prefill"):
            pid = mpirun_pid()
            check(pid is not None, "found mpirun in %s" % H0, job.dump)
            os.kill(pid, signal.SIGUSR1)  # forwarded to every rank: rank 0 drains
            want, bound = 0, 90
        else:
            want, bound = 3, 60  # the client returned after the 503s: the job ends by itself
        t0 = time.monotonic()
        try:
            rc = job.proc.wait(bound)
        except subprocess.TimeoutExpired:
            rc = None
        check(rc == want, "the job exited %s (want %d) %.1f s later" % (
            rc, want, time.monotonic() - t0), job.dump)
        ok = True
    finally:
        if not ok and job.proc.poll() is None:
            subprocess.run([CLUSTER, "down"])  # ours: the session holds the lock
            job.proc.wait(60)
    deadline = time.monotonic() + 10
    while (our_processes() or our_namespaces()) and time.monotonic() < deadline:
        time.sleep(0.2)
    check(not our_namespaces(), "no namespace left behind: %s" % our_namespaces())
    check(not our_processes(), "no process left behind: %s" % our_processes())


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--inside":
        WHERE = " " + H0
        case, url, p = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
        MODEL = p["model"]
        {"exact": inside_exact, "long_prefill": inside_long_prefill,
         "link_down": inside_fault, "stopped": inside_fault}[case](url, p)
        sys.exit(0)
    TREEATTN, MODEL, CASE = sys.argv[1], sys.argv[2], sys.argv[3]
    driver()
    log("PASS %s (%.1f s)" % (CASE, time.monotonic() - T0))
