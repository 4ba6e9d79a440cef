#!/usr/bin/env python3
"""KV capacity under concurrent long chats: how many requests a server runs at once.

Sends --clients concurrent /v1/chat/completions requests, each a --prompt-words-word document
with a short instruction and NO max_tokens (so a server that reserves KV for the whole context
up front admits far fewer than fit), while polling /metrics every --poll seconds. Reports, as
one JSON object on stdout (and --json FILE):
  running_max        the most requests the engine ran at once (treeattn_requests_running)
  finished           requests answered 200 with a finish_reason
  prompt_tokens      each request's usage.prompt_tokens
  completion_tokens  each request's usage.completion_tokens
  preemptions        treeattn_preemptions_total at the end
  kv_usage_max       per rank, the largest treeattn_kv_usage_ratio seen
  seconds            wall time of the whole burst
Every request carries "stop": ["\\n", " ", "."] so that a small model's answer ends at its first
word (a 135M model asked to answer in one word may otherwise go on for thousands of tokens); stop
strings are not a length limit, and the server cannot know in advance where they match.

Usage: bench/serve/capacity.py --url http://127.0.0.1:18510 [--clients 8] [--prompt-words 870]
Only the Python standard library is needed.
"""
import argparse
import json
import random
import re
import sys
import threading
import time
import urllib.request

WORDS = ("river stone market winter garden letter bridge candle morning harbor silver forest "
         "window engine pocket mountain lantern meadow thunder compass orchard velvet signal "
         "quarry tunnel pepper saddle ribbon anchor beacon cotton falcon glacier hammer island "
         "jacket kettle ladder marble needle oyster parrot quiver rocket summit timber umbrella "
         "valley walnut yellow zephyr").split()


def metrics(url):
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"^(\S+)\s+(\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def chat(url, model, words, seed, results, i):
    rng = random.Random(seed)
    doc = " ".join(rng.choice(WORDS) for _ in range(words))
    body = {
        "model": model,
        "messages": [{"role": "user",
                      "content": "Here is a list of words:\n" + doc +
                                 "\nWhich word comes first in the list? Answer with one word."}],
        "temperature": 0,
        "stop": ["\n", " ", "."],
    }
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=3600) as r:
            results[i] = {"status": r.status, "body": json.loads(r.read())}
    except urllib.error.HTTPError as e:
        results[i] = {"status": e.code, "body": e.read().decode(errors="replace")}
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        results[i] = {"status": 0, "body": repr(e)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=870)
    ap.add_argument("--poll", type=float, default=0.05)
    ap.add_argument("--json")
    a = ap.parse_args()
    url = a.url.rstrip("/")
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        model = json.loads(r.read())["data"][0]["id"]
    results = [None] * a.clients
    threads = [threading.Thread(target=chat, args=(url, model, a.prompt_words, 100 + i, results, i))
               for i in range(a.clients)]
    t0 = time.time()
    for t in threads:
        t.start()
    running_max, usage_max, m = 0, {}, {}
    while any(t.is_alive() for t in threads):
        try:
            m = metrics(url)
        except Exception:  # noqa: BLE001 - a busy server may miss one poll
            time.sleep(a.poll)
            continue
        running_max = max(running_max, int(m.get("treeattn_requests_running", 0)))
        for k, v in m.items():
            if k.startswith("treeattn_kv_usage_ratio{"):
                usage_max[k] = max(usage_max.get(k, 0.0), v)
        time.sleep(a.poll)
    for t in threads:
        t.join()
    seconds = time.time() - t0
    m = metrics(url)
    ok = [r for r in results if r and r["status"] == 200]
    out = {
        "clients": a.clients,
        "running_max": running_max,
        "finished": sum(1 for r in ok if r["body"]["choices"][0].get("finish_reason")),
        "failed": [r for r in results if not r or r["status"] != 200],
        "prompt_tokens": [r["body"]["usage"]["prompt_tokens"] for r in ok],
        "completion_tokens": [r["body"]["usage"]["completion_tokens"] for r in ok],
        "preemptions": int(m.get("treeattn_preemptions_total", 0)),
        "kv_usage_max": {re.search(r'rank="(\d+)"', k).group(1): v for k, v in usage_max.items()},
        "seconds": round(seconds, 2),
    }
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0 if out["finished"] == a.clients else 1


if __name__ == "__main__":
    sys.exit(main())
