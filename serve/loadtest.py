"""A bounded HTTP load test: N concurrent clients for T seconds against an OpenAI-compatible server.

Each client sends ``POST /v1/completions`` one at a time (a token-id prompt, fixed length) until
the time is up; every request is accounted for by how it ended:

- ``by_code``: HTTP responses per status code;
- ``lost``: requests that got no HTTP response at all (connection dropped, client timeout);
- ``versions``: completed responses per weight version (``rlfleet.weight_version``; absent from
  a server that does not tag them);
- ``errors``: the first few non-200 answers, with their messages.

``scripts/load_http.py`` runs it from a shell; the HTTP integration tests run it with a refit
in the middle.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from typing import Any


async def _client(http: Any, url: str, model: str | None, end: float, rng: random.Random, max_tokens: int,
                  out: dict, timeout_s: float) -> None:
    while time.monotonic() < end:
        body = {"prompt": [rng.randrange(1, 400) for _ in range(8)], "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 1.0}
        if model is not None:
            body["model"] = model
        out["sent"] += 1
        t0 = time.monotonic()
        try:
            r = await http.post(f"{url}/v1/completions", json=body, timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - any transport failure is a request without an answer
            out["lost"] += 1
            if len(out["errors"]) < 10:
                out["errors"].append(f"no response: {type(exc).__name__}: {exc}")
            continue
        out["by_code"][r.status_code] += 1
        if r.status_code == 200:
            data = r.json()
            out["latencies"].append(time.monotonic() - t0)
            out["tokens"] += int(data.get("usage", {}).get("completion_tokens", 0))
            tag = data.get("rlfleet") or {}
            out["versions"][tag.get("weight_version")] += 1
        elif len(out["errors"]) < 10:
            out["errors"].append(f"{r.status_code}: {r.text[:300]}")


async def run_load(url: str, clients: int = 8, seconds: float = 10.0, max_tokens: int = 16,
                   model: str | None = None, seed: int = 0, timeout_s: float = 120.0) -> dict[str, Any]:
    """Run the load; returns the accounting (see the module docstring). ``sent == answered + lost`` always."""
    import httpx

    out: dict[str, Any] = {"sent": 0, "lost": 0, "tokens": 0, "by_code": Counter(), "versions": Counter(),
                           "latencies": [], "errors": []}
    end = time.monotonic() + seconds
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits) as http:
        await asyncio.gather(*(_client(http, url, model, end, random.Random(seed * 1000 + i), max_tokens, out, timeout_s)
                               for i in range(clients)))
    wall = time.monotonic() - t0
    lat = sorted(out.pop("latencies"))
    answered = sum(out["by_code"].values())
    return {
        **out,
        "by_code": {str(k): v for k, v in sorted(out["by_code"].items())},
        "versions": {str(k): v for k, v in sorted(out["versions"].items(), key=lambda kv: str(kv[0]))},
        "answered": answered,
        "server_errors": sum(v for k, v in out["by_code"].items() if k >= 500),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(out["tokens"] / wall, 2) if wall > 0 else 0.0,
        "p50_s": round(lat[len(lat) // 2], 4) if lat else None,
        "clients": clients,
        "seconds": seconds,
    }
