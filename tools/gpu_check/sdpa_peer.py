#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on the GPU check's bandwidth shapes (the peer).

llama3-8b decode shape (32 query heads, 8 KV heads, head dim 128, one query, bf16) at 64k, 256k and
1M tokens, batch 1 and 16: time per call (CUDA events, best of a few) and GB/s of KV read, written
to OUTDIR/sdpa.json. Grouped-query attention goes through enable_gqa=True (torch >= 2.5); an older
torch, no torch, no GPU or a shape that does not fit is recorded with its reason, never an error.
"""
import json
import sys


def main(outdir):
    result = {"available": False, "shapes": []}
    try:
        import torch
        import torch.nn.functional as F
    except Exception as e:  # noqa: BLE001 - any import failure means "no peer"
        result["reason"] = f"torch not importable: {e}"
        return result
    result["torch"] = torch.__version__
    if not torch.cuda.is_available():
        result["reason"] = "torch sees no CUDA device"
        return result
    result["available"] = True
    result["device"] = torch.cuda.get_device_name(0)
    heads, kv_heads, dim = 32, 8, 128
    for batch in (1, 16):
        for tokens in (65536, 262144, 1048576):
            row = {"batch": batch, "tokens": tokens,
                   "kv_bytes": batch * kv_heads * tokens * dim * 2 * 2}
            k = v = q = None
            try:
                k = torch.empty(batch, kv_heads, tokens, dim, dtype=torch.bfloat16, device="cuda")
                v = torch.empty_like(k)
                k.uniform_(-1, 1)
                v.uniform_(-1, 1)
                q = torch.randn(batch, heads, 1, dim, dtype=torch.bfloat16, device="cuda")

                def run():
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

                run()
                torch.cuda.synchronize()
                reps = max(3, min(50, int(2e9 / row["kv_bytes"])))
                best = float("inf")
                start = torch.cuda.Event(enable_timing=True)
                stop = torch.cuda.Event(enable_timing=True)
                for _ in range(3):
                    start.record()
                    for _ in range(reps):
                        run()
                    stop.record()
                    stop.synchronize()
                    best = min(best, start.elapsed_time(stop) / reps)
                row["ms"] = best
                row["gbps"] = row["kv_bytes"] / (best * 1e6)
            except TypeError as e:
                row["error"] = f"this torch has no enable_gqa: {e}"
            except Exception as e:  # noqa: BLE001 - out of memory and friends: record, go on
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            finally:
                del k, v, q
                torch.cuda.empty_cache()
            result["shapes"].append(row)
            print(f"  sdpa B={batch} N={tokens}: "
                  + (f"{row['gbps']:.0f} GB/s ({row['ms']:.3f} ms)" if "gbps" in row
                     else row.get("error", "?")), flush=True)
    return result


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: sdpa_peer.py OUTDIR")
    res = main(sys.argv[1])
    with open(f"{sys.argv[1]}/sdpa.json", "w") as f:
        json.dump(res, f, indent=2)
    if not res["available"]:
        print(f"  sdpa peer not run: {res.get('reason')}")
