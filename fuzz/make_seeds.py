#!/usr/bin/env python3
"""Writes the checked-in seed corpora of the fuzz targets (fuzz/corpus/<target>/), so that each
campaign starts from valid inputs of every shape the parsers know instead of from nothing:

  fuzz_topology     every preset (from `treeattn topo --show`, when a built treeattn is given),
                    a minimal file, both level layouts, and a few malformed ones
  fuzz_cli_parsers  sizes, lists, counts and --inject specs (first byte: which parser)
  fuzz_gguf         small GGUF v2/v3 files: every metadata value type, arrays, alignment, and
                    tensors of each readable type (f32, f16, bf16, q8_0, q4_0, q4_1) and one
                    unreadable (q6_K), built here byte by byte from the format description
  fuzz_tokenizer    texts: ASCII, digits, code, whitespace runs, accents, CJK, emoji, ChatML
                    (first byte: which tokenizer and flags)
  fuzz_serve_request  OpenAI chat and completions bodies, /tokenize and /detokenize bodies,
                    valid and malformed (first byte: the endpoint and the limits)
  fuzz_http_request pipelines of HTTP/1.x requests: plain, Content-Length and chunked bodies,
                    100-continue, and each refusal (first byte: the limits and the piece size)
  fuzz_jinja        chat templates: the real ones of tests/model/jinja/data/templates, small ones
                    of each construct, and hostile ones (deep nesting, huge loops, recursion
                    through macros, huge strings, self-referencing namespaces); some followed by
                    a NUL and a JSON conversation
  fuzz_structured   response formats: the 20 schemas of tests/model/structured/data/schemas.json,
                    json_object, text, and hostile ones (deep nesting, huge enums, recursive and
                    unresolvable references, unsatisfiable and unsupported schemas); some
                    followed by a NUL and steering bytes

Usage: fuzz/make_seeds.py [path/to/treeattn]. Deterministic; rerun after changing it."""
import json
import os
import struct
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


# ---- topology ------------------------------------------------------------------------------
def topology(treeattn):
    minimal = {"format": "treeattn-topology/1", "name": "m", "nodes": 1, "ranks_per_node": 1,
               "memory": {"bandwidth_GBps": 10},
               "levels": [{"name": "node", "latency_us": 1, "bandwidth_GBps": 5}]}
    write("fuzz_topology", "minimal.json", json.dumps(minimal))
    two = dict(minimal, name="two", nodes=2, ranks_per_node=4, collectives="nccl",
               collective_overhead_us=1.5, description="two levels",
               compute={"peak_TFLOPs": 2, "kernel_overhead_us": 3, "max_concurrent_ranks": 2},
               sources=["made up"])
    two["memory"] = {"bandwidth_GBps": 30, "capacity_GB": 16}
    two["levels"] = [{"name": "node", "latency_us": 0.5, "bandwidth_GBps": 9},
                     {"name": "network", "latency_us": 12, "bandwidth_GBps": 0.125,
                      "links_per_node": 1, "call_overhead_us": 40}]
    write("fuzz_topology", "two-levels.json", json.dumps(two, indent=2))
    write("fuzz_topology", "bad-number.json", json.dumps(minimal).replace("10}", "1e400}"))
    write("fuzz_topology", "bad-dup.json", json.dumps(minimal).replace('"nodes": 1', '"nodes": 1, "nodes": 2'))
    write("fuzz_topology", "bad-deep.json", "[" * 70 + "]" * 70)
    write("fuzz_topology", "bad-syntax.json", '{"format": "treeattn-topology/1", "name": ')
    if treeattn:
        for preset in ["dgx-h100x16", "mi300x4", "rtx4090x2", "local", "emu-veth", "emu-1gbit"]:
            out = subprocess.run([treeattn, "topo", "--show", "preset:" + preset],
                                 capture_output=True, text=True, check=True).stdout
            write("fuzz_topology", "preset-" + preset + ".json", out[out.index("{"):])


# ---- CLI parsers ---------------------------------------------------------------------------
def cli():
    seeds = [(0, "4096"), (0, "64k"), (0, "1M"), (0, "1.5M"), (0, "5.12M"), (0, "0"), (0, "7G"),
             (0, "0x10"), (0, "1e3"), (1, "1k,4k,1M"), (1, "1,,2"), (1, ","), (2, "123"),
             (2, "99999999999"), (3, "tree,ring-kv,,all"), (4, "kill:1@3"), (4, "slow:2:50"),
             (4, "never-arrive:0@0"), (4, "nan:3"), (4, "mismatch:1"), (4, "kill:1")]
    for i, (sel, text) in enumerate(seeds):
        write("fuzz_cli_parsers", "seed-%02d" % i, bytes([sel]) + text.encode())


# ---- GGUF ----------------------------------------------------------------------------------
def gstr(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


SCALARS = [(0, "<B", 7), (1, "<b", -7), (2, "<H", 700), (3, "<h", -700), (4, "<I", 70000),
           (5, "<i", -70000), (6, "<f", 1.5), (7, "<B", 1), (10, "<Q", 2**40), (11, "<q", -2**40),
           (12, "<d", 2.25)]


def gguf(version, kvs, tensors, alignment=32):
    """kvs: list of (key, type, payload bytes); tensors: list of (name, dims, type, data)."""
    head = b"GGUF" + struct.pack("<I", version) + struct.pack("<QQ", len(tensors), len(kvs))
    body = b""
    for key, t, payload in kvs:
        body += gstr(key) + struct.pack("<I", t) + payload
    offset = 0
    infos = b""
    datas = []
    for name, dims, t, data in tensors:
        infos += gstr(name) + struct.pack("<I", len(dims))
        for d in dims:
            infos += struct.pack("<Q", d)
        infos += struct.pack("<IQ", t, offset)
        datas.append((offset, data))
        offset += (len(data) + alignment - 1) // alignment * alignment
    out = head + body + infos
    out += b"\0" * ((-len(out)) % alignment)
    blob = bytearray(offset)
    for off, data in datas:
        blob[off:off + len(data)] = data
    return out + bytes(blob)


def f16(x):
    return struct.pack("<e", x)


def gguf_seeds():
    kvs = [("general.architecture", 8, gstr("llama")), ("general.alignment", 4, struct.pack("<I", 32))]
    for t, fmt, v in SCALARS:
        kvs.append(("scalar.type%d" % t, t, struct.pack(fmt, v)))
    kvs.append(("array.i32", 9, struct.pack("<IQ", 5, 3) + struct.pack("<3i", 1, -2, 3)))
    kvs.append(("array.f64", 9, struct.pack("<IQ", 12, 2) + struct.pack("<2d", 0.5, -1e300)))
    kvs.append(("array.str", 9, struct.pack("<IQ", 8, 2) + gstr("a") + gstr("bc")))
    kvs.append(("array.empty", 9, struct.pack("<IQ", 0, 0)))
    rows, cols = 2, 64
    f32 = b"".join(struct.pack("<f", (i % 7) - 3.0) for i in range(rows * cols))
    f16s = b"".join(f16((i % 5) - 2.0) for i in range(rows * cols))
    bf16 = b"".join(struct.pack("<f", (i % 3) - 1.0)[2:] for i in range(rows * cols))
    q8 = b"".join(f16(0.25) + bytes((j * 7) % 256 for j in range(32)) for _ in range(rows * cols // 32))
    q40 = b"".join(f16(0.5) + bytes((j * 13) % 256 for j in range(16)) for _ in range(rows * cols // 32))
    q41 = b"".join(f16(0.5) + f16(-1.0) + bytes((j * 11) % 256 for j in range(16)) for _ in range(rows * cols // 32))
    tensors = [("w.f32", [cols, rows], 0, f32), ("w.f16", [cols, rows], 1, f16s),
               ("w.bf16", [cols, rows], 30, bf16), ("w.q8_0", [cols, rows], 8, q8),
               ("w.q4_0", [cols, rows], 2, q40), ("w.q4_1", [cols, rows], 3, q41),
               ("w.q6_k", [256, 1], 14, bytes(210)), ("v.1d", [cols], 0, f32[:cols * 4])]
    write("fuzz_gguf", "full-v3.gguf", gguf(3, kvs, tensors))
    write("fuzz_gguf", "full-v2.gguf", gguf(2, kvs[:4], tensors[:2]))
    write("fuzz_gguf", "empty-v3.gguf", gguf(3, [], []))
    write("fuzz_gguf", "meta-only.gguf", gguf(3, kvs, []))
    kv64 = [("general.alignment", 4, struct.pack("<I", 64))]
    write("fuzz_gguf", "align64.gguf", gguf(3, kv64, tensors[:1], alignment=64))
    # A tokenizer header like the one fuzz_tokenizer builds (without tensors).
    toks = [chr(c) for c in range(33, 127)] + ["Ġt", "he", "<|im_start|>"]
    tk = [("tokenizer.ggml.model", 8, gstr("gpt2")), ("tokenizer.ggml.pre", 8, gstr("smollm")),
          ("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, len(toks)) + b"".join(gstr(t) for t in toks)),
          ("tokenizer.ggml.merges", 9, struct.pack("<IQ", 8, 2) + gstr("Ġ t") + gstr("h e"))]
    write("fuzz_gguf", "tokenizer.gguf", gguf(3, tk, []))
    write("fuzz_gguf", "truncated.gguf", gguf(3, kvs, tensors)[:200])


# ---- tokenizer -----------------------------------------------------------------------------
def tokenizer():
    texts = ["the cat sat on the mat", "Hello, World! 12345 67890", "  leading and   runs  \n\n\t end",
             "def f(x):\n    return x ** 2  # square\n", "caf\u00e9 na\u00efve \u00e9t\u00e9",
             "\u4e2d\u6587\u6d4b\u8bd5 \u65e5\u672c\u8a9e", "emoji \U0001F600\U0001F680 ok",
             "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n", "<user_tok>abc<user_tok>",
             "ab bc 123 1234 the he", "I'm you're we'll they've it's", "\u00a0\u2003\u3000 spaces",
             "x" * 300, "1" * 50]
    for i, t in enumerate(texts):
        write("fuzz_tokenizer", "seed-%02d" % i, bytes([(i * 7) % 64]) + t.encode())


def serve_request():
    chat, completion = b"\x01", b"\x00"
    bodies = [
        chat + b'{"model":"m","messages":[{"role":"user","content":"Hi"}]}',
        chat + b'{"messages":[{"role":"system","content":"S"},{"role":"user","content":'
               b'[{"type":"text","text":"a\\u00e9"}]}],"max_tokens":5,"temperature":0.7,'
               b'"top_p":0.9,"seed":42,"stop":["\\n","END"],"stream":true,'
               b'"stream_options":{"include_usage":true}}',
        chat + b'{"messages":[{"role":"user","content":"x"}],"n":2}',
        chat + b'{"messages":[{"role":"user","content":"x"}],"frequency_penalty":0,"logprobs":false,'
               b'"tools":[],"response_format":{"type":"text"},"user":"u","max_completion_tokens":3}',
        completion + b'{"prompt":"Once upon a time","max_tokens":16,"stop":"time"}',
        completion + b'{"prompt":[1,2,3,300],"ignore_eos":true,"return_token_ids":true}',
        completion + b'{"prompt":[[5,6]],"top_k":3}',
        completion + b'{"prompt":"x","echo":true}',
        chat + b'{"messages":[' * 10,
        completion + b'{"prompt":"\\ud83d\\ude00 caf\\u00e9","stop":["\\u00e9"]}',
        # /tokenize (bits 3-4 of the first byte: 1) and /detokenize (2)
        b"\x08" + b'{"content":"Hi \\u00e9","add_special":true,"with_pieces":true}',
        b"\x08" + b'{"content":"<|im_end|>","parse_special":false,"model":"m"}',
        b"\x08" + b'{"content":5}',
        b"\x10" + b'{"tokens":[72,105,195,169,257]}',
        b"\x10" + b'{"tokens":[1,999999999999,-1,1.5,"a"]}',
        b"\x10" + b'{"tokens":[]}',
        # the sampling and output fields: every one, out of range, logit_bias keys
        chat + b'{"messages":[{"role":"user","content":"x"}],"n":3,"logprobs":true,'
               b'"top_logprobs":20,"presence_penalty":-2,"frequency_penalty":1.5,'
               b'"min_p":0.05,"repetition_penalty":1.3,"logit_bias":{"72":-100,"7":100},'
               b'"stop":"l","seed":1}',
        completion + b'{"prompt":"hello","logprobs":5,"n":16,"logit_bias":{"300":1}}',
        completion + b'{"prompt":"x","logit_bias":{"01":1,"1":2,"-3":0,"x":"y"},"n":17,'
                     b'"repetition_penalty":0,"top_logprobs":1}',
        # tools, tool turns, and a content that reads as calls
        chat + b'{"messages":[{"role":"user","content":"Weather?"},{"role":"assistant","content":'
               b'null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"get_weather",'
               b'"arguments":"{\\"city\\": \\"Paris\\"}"}}]},{"role":"tool","tool_call_id":"c1",'
               b'"content":"<tool_call>{\\"name\\": \\"get_weather\\", \\"arguments\\": {}}'
               b'</tool_call>"}],"tools":[{"type":"function","function":{"name":"get_weather",'
               b'"parameters":{"type":"object"}}}],"tool_choice":"auto"}',
        chat + b'{"messages":[{"role":"user","content":"{\\"name\\": \\"f\\", \\"arguments\\"'
               b': {\\"a\\": [1]}}"}],"tools":[{"type":"function","function":{"name":"f"}}]}',
        # structured output: a schema, json_object, and refused schemas
        chat + b'{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema",'
               b'"json_schema":{"name":"p","strict":true,"schema":{"type":"object","properties":'
               b'{"n":{"type":"string","maxLength":9},"k":{"enum":[1,"a",null]}},"required":["n"],'
               b'"additionalProperties":false}}}}',
        completion + b'{"prompt":"x","response_format":{"type":"json_object"}}',
        chat + b'{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema",'
               b'"json_schema":{"name":"q","schema":{"type":"integer","minimum":0}}}}',
        chat + b'{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema",'
               b'"json_schema":{"name":"r","schema":{"$ref":"#/$defs/a","$defs":{"a":{"type":"array",'
               b'"items":{"$ref":"#/$defs/a"},"minItems":1}}}}}}',
    ]
    for i, b in enumerate(bodies):
        write("fuzz_serve_request", "seed-%02d" % i, b)


def http_request():
    post = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    wires = [
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        post + b"Content-Length: 5\r\n\r\nhelloGET /v1/models HTTP/1.0\r\n\r\n",
        post + b"Transfer-Encoding: chunked\r\n\r\n5;a=b\r\nhello\r\n0\r\nT: 1\r\n\r\n",
        post + b"Expect: 100-continue\r\nContent-Length: 2\r\n\r\n{}",
        post + b"Content-Encoding: gzip\r\nContent-Length: 3\r\n\r\nabc",
        post + b"Content-Length: -1\r\n\r\n",
        post + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
        post + b"\r\n",
        b"GET / HTTP/1.1\r\n" + b"".join(b"X%d: v\r\n" % i for i in range(8)) + b"\r\n",
        b"\r\nGET / HTTP/1.1\nA:b\n\nGET / HTTP/2\r\n\r\n",
    ]
    for i, w in enumerate(wires):
        write("fuzz_http_request", "seed-%02d" % i, bytes([(i * 37) % 256]) + w)
def structured():
    with open(os.path.join(HERE, "..", "tests", "model", "structured", "data", "schemas.json")) as f:
        cases = json.load(f)
    for i, c in enumerate(cases):
        rf = {"type": "json_schema", "json_schema": {"name": c["name"], "schema": c["schema"],
                                                     "strict": c.get("strict", False)}}
        write("fuzz_structured", "schema-%02d" % i,
              json.dumps(rf) + ("\0" + "\x01\x07\x03\x10\x05" * 8 if i % 3 == 0 else ""))
    def schema(s):
        return json.dumps({"type": "json_schema", "json_schema": {"name": "h", "schema": s}})
    deep = {"type": "integer"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    hostile = [
        json.dumps({"type": "json_object"}) + "\0" + "\x02" * 64,
        json.dumps({"type": "text"}),
        schema(deep),
        schema({"enum": ["v%d" % i for i in range(3000)]}),
        schema({"$ref": "#"}),
        schema({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
        schema({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
        schema({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"},
                                          {"type": "array", "items": {"$ref": "#"}}]}},
                "$ref": "#/$defs/a"}) + "\0" + "\x01" * 64,
        schema({"type": "array", "minItems": 2, "maxItems": 1}),
        schema({"type": "string", "pattern": "^a$"}),
        schema({"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                          {"type": "object", "properties": {"a": {"type": "string"}}},
                          {"type": "object", "additionalProperties": True}]}),
        schema({"type": ["integer", "number", "null", "boolean"], "enum": [1, 1.5, None, "x"]}),
    ]
    for i, t in enumerate(hostile):
        write("fuzz_structured", "hostile-%02d" % i, t)


def jinja():
    tdir = os.path.join(HERE, "..", "tests", "model", "jinja", "data", "templates")
    for name in sorted(os.listdir(tdir)):
        with open(os.path.join(tdir, name), "rb") as f:
            write("fuzz_jinja", "real-" + name.replace(".jinja", ""), f.read())
    small = [
        "{% for m in messages %}{{ loop.index0 }}:{{ m.role | upper }}={{ m.content | trim }}"
        "{% if not loop.last %}\n{% endif %}{% endfor %}",
        "{%- set ns = namespace(found=false) -%}{%- for m in messages[::-1] if m.role == 'user' %}"
        "{%- if not ns.found %}{{ m.content.split('<')[0].strip() }}{% set ns.found = true %}"
        "{% endif %}{% endfor %}",
        "{% macro show(x, sep=', ') %}{{ x | map(attribute='role') | join(sep) }}{% endmacro %}"
        "{{ show(messages) }}{% call show(messages) %}{% endcall %}",
        "{{ tools | tojson(indent=2) }}{{ messages | selectattr('role', 'equalto', 'tool') | list"
        " | length }}{{ {'a': [1, 2.5, none, true]} | tojson }}",
        "{{ 'x' ~ 1 ~ 2.0 ~ none ~ [1, 'a'] ~ (1,) }}{{ 7 // 2 }}{{ -7 % 3 }}{{ 2 ** 10 }}"
        "{{ 'abc'[1:] }}{{ 'a,b'.split(',') }}{{ range(3) | list }}",
        "{% set x %}block {{ bos_token }}{% endset %}{{ x | replace('block', 'B') }}"
        "{{ raise_exception('stop') if x is not string }}{{ strftime_now('%Y') | length }}",
        "{# comment #}  {%- if a is defined and a.b is mapping -%} {{ a.b.get('c', 'd') }}"
        "{%- elif messages[0].content is string %}{{ messages[0]['content'][-3:] }}{% else %}"
        "{% endif -%}\n",
    ]
    hostile = [
        "{% if true %}" * 200,
        "{{ " + "(" * 500 + "1" + ")" * 500 + " }}",
        "{{ " + "-" * 500 + "1 }}",
        "{{ " + "[" * 300 + "]" * 300 + " }}",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "{% macro f(n) %}{{ f(n) ~ f(n) }}{% endmacro %}{{ f(0) }}",
        "{% for i in range(1000000000) %}{% endfor %}",
        "{% for i in range(100) %}{% for j in range(100) %}{% for k in range(100) %}x"
        "{% endfor %}{% endfor %}{% endfor %}",
        "{{ 'x' * 1000000000 }}",
        "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s | length }}",
        "{% set ns = namespace() %}{% set ns.me = ns %}{{ ns.me.me.me }}{{ ns | tojson }}",
        "{% set ns = namespace(x=[]) %}{% for i in range(500) %}{% set ns.x = [ns.x] %}"
        "{% endfor %}{{ ns.x | tojson }}",
        "{{ messages[0]['content'] ",
        "{% for %}{% endfor %}{% endif %}",
        "{{ 9223372036854775807 + 1 }}{{ 1 // 0 }}",
        "{{ '\\u12' }}{{ \"\\xZZ\" }}",
    ]
    for i, t in enumerate(small + hostile):
        write("fuzz_jinja", "seed-%02d" % i, t)
    conv = {"messages": [{"role": "user", "content": "x" * 100}], "a": {"b": {"c": 1}}}
    write("fuzz_jinja", "seed-ctx", small[6] + "\0" + json.dumps(conv))


if __name__ == "__main__":
    topology(sys.argv[1] if len(sys.argv) > 1 else None)
    cli()
    gguf_seeds()
    tokenizer()
    serve_request()
    http_request()
    jinja()
    structured()
