"""A bounded load test against a running ``rlfleet serve`` (or any OpenAI-compatible server).

    python scripts/load_http.py --url http://127.0.0.1:8000 [--clients 8] [--seconds 30] [--max-tokens 16]

N clients send completions one at a time for T seconds. The last line is one JSON object:
requests ``sent``, ``answered`` (by status code in ``by_code``), ``lost`` (no HTTP answer at all),
``server_errors`` (5xx), completed responses per weight version, tokens per second and p50 latency.
Exits 1 if any request was lost or answered with a 5xx.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from rlfleet.serve.loadtest import run_load


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default=None, help="the model name to send (default: none, the server's own)")
    args = ap.parse_args()
    out = asyncio.run(run_load(args.url.rstrip("/"), args.clients, args.seconds, args.max_tokens, args.model))
    print(json.dumps(out))
    return 1 if out["lost"] or out["server_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
