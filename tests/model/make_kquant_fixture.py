#!/usr/bin/env python3
"""Writes tests/model/data/kquant_dequant.bin: random blocks of the quantized GGUF types and
their values as the `gguf` package (gguf-py, llama.cpp's Python reader) dequantizes them, for
test_kquants.cpp to compare with gguf::dequantize_row bit for bit. Run outside CI:

    python3 -m venv /tmp/kq-venv && /tmp/kq-venv/bin/pip install gguf numpy
    /tmp/kq-venv/bin/python tests/model/make_kquant_fixture.py tests/model/data/kquant_dequant.bin

The blocks are random bytes with every f16 field (d, m, dmin) replaced by a finite value: normal
magnitudes from 2^-14 to 2^2 of either sign, plus a few zeros and f16 subnormals, so that every
code, scale and min bit pattern occurs. Q5_0 and Q5_1 also get blocks from gguf's own quantizer.

File format (little-endian): b"TAKQ", uint32 version 1, uint32 entry count, then per entry:
uint32 ggml type id, uint32 value count n, uint32 byte count b, b bytes of blocks, n float32.
"""
import struct
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

# Byte offsets of the f16 fields in each block, and (values, bytes) per block.
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}
BLOCKS = {T.Q4_0: 24, T.Q4_1: 24, T.Q5_0: 48, T.Q5_1: 48, T.Q8_0: 16,
          T.Q4_K: 24, T.Q5_K: 24, T.Q6_K: 24}


def random_f16(rng, n):
    mag = np.exp2(rng.uniform(-14, 2, n)).astype(np.float16)
    sign = np.where(rng.random(n) < 0.5, -1, 1).astype(np.float16)
    v = mag * sign
    special = rng.random(n)
    v[special < 0.04] = np.float16(0.0)
    sub = (special >= 0.04) & (special < 0.08)
    v[sub] = (rng.integers(1, 1024, sub.sum()) * np.float16(2.0**-24)).astype(np.float16)
    return v


def main(out):
    rng = np.random.default_rng(20261201)
    entries = []
    for t, nb in BLOCKS.items():
        elems, size = quants.GGML_QUANT_SIZES[t]
        raw = rng.integers(0, 256, (nb, size), dtype=np.uint8)
        for off in F16_FIELDS[t]:
            raw[:, off:off + 2] = random_f16(rng, nb).view(np.uint8).reshape(nb, 2)
        data = raw.reshape(-1)
        if t in (T.Q5_0, T.Q5_1):  # gguf's quantizer for a few more realistic blocks
            x = rng.normal(0, 1, 8 * elems).astype(np.float32)
            data = np.concatenate([data, quants.quantize(x, t).reshape(-1)])
        vals = quants.dequantize(data, t).astype(np.float32).reshape(-1)
        assert vals.size == data.size // size * elems
        assert np.all(np.isfinite(vals)), t.name
        entries.append((int(t), data.tobytes(), vals.astype("<f4").tobytes(), vals.size))
    with open(out, "wb") as f:
        f.write(b"TAKQ" + struct.pack("<II", 1, len(entries)))
        for t, data, vals, n in entries:
            f.write(struct.pack("<III", t, n, len(data)))
            f.write(data)
            f.write(vals)


if __name__ == "__main__":
    main(sys.argv[1])
