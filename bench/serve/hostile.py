#!/usr/bin/env python3
"""/health and a short chat under slow and idle connections (issue 56's targets).

Measures, against a running `treeattn serve` (or any OpenAI-compatible server):
  /health      --probes requests, each on a fresh connection: p50 / p99 / max (ms)
  chat         --chats 2-token greedy chat completions, one after another: p50 / max (ms)
first with no other connection open (baseline), then with --slow connections that each send a
request head one byte every --trickle seconds (slowloris) and --idle connections that send
nothing, all held open from this process (loopback: start the server with --max-conns-per-peer 0
or above their count, else the cap refuses most of them, which is the point of the cap but not
of this measurement). Prints one table row per phase and how many of the held connections the
server had closed by the end.

Usage:
  bench/serve/hostile.py --url http://127.0.0.1:8080 [--slow 1000] [--idle 1000] [--key KEY]

Only the Python standard library is needed.
"""
import argparse
import http.client
import json
import resource
import socket
import statistics
import threading
import time
import urllib.parse


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def health_ms(host, port):
    t0 = time.perf_counter()
    c = http.client.HTTPConnection(host, port, timeout=60)
    c.request("GET", "/health")
    c.getresponse().read()
    c.close()
    return (time.perf_counter() - t0) * 1000


def chat_ms(host, port, key):
    body = json.dumps({"model": "any", "max_tokens": 2, "temperature": 0,
                       "messages": [{"role": "user", "content": "Say hi."}]})
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = "Bearer " + key
    t0 = time.perf_counter()
    c = http.client.HTTPConnection(host, port, timeout=300)
    c.request("POST", "/v1/chat/completions", body, headers)
    r = c.getresponse()
    r.read()
    c.close()
    if r.status != 200:
        raise SystemExit("chat: HTTP %d" % r.status)
    return (time.perf_counter() - t0) * 1000


def measure(name, host, port, args):
    h = [health_ms(host, port) for _ in range(args.probes)]
    c = [chat_ms(host, port, args.key) for _ in range(args.chats)]
    print("| %s | %.1f | %.1f | %.1f | %.0f | %.0f |" %
          (name, statistics.median(h), pct(h, 99), max(h), statistics.median(c), max(c)),
          flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--slow", type=int, default=1000)
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument("--trickle", type=float, default=5.0)
    ap.add_argument("--probes", type=int, default=50)
    ap.add_argument("--chats", type=int, default=5)
    ap.add_argument("--key", default="")
    args = ap.parse_args()
    u = urllib.parse.urlparse(args.url)
    host, port = u.hostname, u.port or 80
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    print("| phase | /health p50 ms | p99 | max | 2-token chat p50 ms | max |")
    print("|---|---|---|---|---|---|")
    measure("baseline", host, port, args)

    held, stop = [], threading.Event()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4096
    for i in range(args.slow + args.idle):
        s = socket.create_connection((host, port), timeout=10)
        held.append((s, i < args.slow))
    closed = set()

    def trickle():
        pos = 0
        while not stop.is_set():
            for k, (s, slow) in enumerate(held):
                if not slow or k in closed:
                    continue
                try:
                    s.send(head[pos:pos + 1])
                except OSError:
                    closed.add(k)
            pos = (pos + 1) % len(head)
            stop.wait(args.trickle)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    time.sleep(1)
    measure("%d slow + %d idle open" % (args.slow, args.idle), host, port, args)
    stop.set()
    t.join()
    for k, (s, _) in enumerate(held):  # closed by the server (a cap, a deadline)?
        s.setblocking(False)
        try:
            if s.recv(1 << 16) == b"":
                closed.add(k)
        except BlockingIOError:
            pass
        except OSError:
            closed.add(k)
        s.close()
    print("\nheld connections the server had closed: %d of %d" % (len(closed), len(held)))


if __name__ == "__main__":
    main()
