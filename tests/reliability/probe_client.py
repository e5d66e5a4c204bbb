"""Loop-stall probes, run as their own process against a server (see test_loop_stall.py).

A separate process so that building a 4 MB body or parsing 64 streams costs the
client's interpreter, never the server's event loop the test measures.
Prints one JSON object: each probe's outcome.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from typing import Any

import httpx

from aiolm.params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOTAL_CHARS


async def _stream(c: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    text, finish, chunks, lps = "", None, 0, 0
    async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "error": json.loads(await r.aread())["error"]}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                return {"status": 200, "error": obj["error"]}
            for ch in obj["choices"]:
                text += ch["text"]
                finish = ch["finish_reason"] or finish
                if ch.get("logprobs"):
                    lps += sum(len(t) >= 20 for t in ch["logprobs"]["top_logprobs"])
            chunks += 1
    return {"status": 200, "text": text, "finish_reason": finish, "chunks": chunks, "full_logprobs": lps}


async def _timed(name: str, marks: list, coro: Any) -> Any:
    marks.append((name, time.time(), None))
    out = await coro
    marks[-1] = (name, marks[-1][1], time.time())
    return out


async def probes(base: str) -> dict[str, Any]:
    res: dict[str, Any] = {}
    marks: list = []
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=httpx.Limits(max_connections=100)) as c:
        the = (await c.post("/tokenize", json={"prompt": " the", "add_special_tokens": False})).json()["tokens"]
        assert len(the) == 1
        # 1. Stop strings at the cap that the text keeps nearly matching: the whole text is held back.
        # Just over the cap's worth of " the" (4 chars a token), so that the hold-back window fills.
        near = [(" the" * (MAX_STOP_STRING_CHARS // 4))[:-1] + x for x in "XYZW"]
        assert sum(map(len, near)) <= MAX_STOP_TOTAL_CHARS
        res["stop_at_cap_tokens"] = n = MAX_STOP_STRING_CHARS // 4 + 14
        body = {
            "prompt": "Repeat after me:",
            "max_tokens": n,
            "temperature": 0.0,
            "ignore_eos": True,
            "logit_bias": {str(the[0]): 100},
            "stop": near,
        }
        res["stop_at_cap"] = await _timed("stop_at_cap", marks, asyncio.gather(*(_stream(c, body) for _ in range(8))))
        # 2. As many stop strings as allowed.
        many = [f"never-{i:02d}-" + "q" * 50 for i in range(MAX_STOP_STRINGS)]
        body = {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0.0, "ignore_eos": True, "stop": many}
        res["stop_64"] = await _timed("stop_64", marks, asyncio.gather(*(_stream(c, body) for _ in range(8))))
        # 3. Past each cap: a 400 naming the field.
        over = {
            "count": [f"x{i}" for i in range(MAX_STOP_STRINGS + 1)],
            "length": ["y" * (MAX_STOP_STRING_CHARS + 1)],
            "total": ["z" * MAX_STOP_STRING_CHARS] * (MAX_STOP_TOTAL_CHARS // MAX_STOP_STRING_CHARS) + ["w"],
        }
        res["stop_over_cap"] = {}
        for k, stop in over.items():
            r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stop": stop})
            res["stop_over_cap"][k] = {"status": r.status_code, "param": r.json()["error"]["param"]}
        # 4. Twenty logprobs on 64 concurrent streams.
        body = {
            "prompt": "The capital of France is",
            "max_tokens": 16,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": 20,
        }
        res["logprobs_64"] = await _timed("logprobs_64", marks, asyncio.gather(*(_stream(c, body) for _ in range(64))))
        # 5. A 4 MB chat body.
        big = {"messages": [{"role": "user", "content": "word " * ((4 << 20) // 5)}], "max_tokens": 4}
        raw = json.dumps(big).encode()
        r = await _timed(
            "chat_4mb", marks, c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        )
        res["chat_4mb"] = {"status": r.status_code, "bytes": len(raw), "error": r.json().get("error")}
    # 6. A slow body: headers and a few bytes, then nothing.
    host, port = base.split("//")[1].split(":")
    t0 = time.time()
    marks.append(("slow_body", t0, None))
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": '
        )
        reply = s.recv(65536).decode(errors="replace")
    marks[-1] = ("slow_body", t0, time.time())
    res["slow_body"] = {"status_line": reply.split("\r\n", 1)[0], "seconds": time.time() - t0}
    res["marks"] = marks
    return res


if __name__ == "__main__":
    print(json.dumps(asyncio.run(probes(sys.argv[1]))))
