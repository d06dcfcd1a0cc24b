"""A reward function served over HTTP under reward.url's contract (rollout.rewards.http): the reference server, and a
way to put a verifier or a judge on another machine.

    python -m rlhf.reward_server --fn package.module:function --port 8001   # or a built-in: --fn math
    python -m rlhf.run --config ... reward.url=http://127.0.0.1:8001/score

POST any path with {"prompts", "completions", "metadata"}; the answer is {"rewards": [...]}, from
`function(prompts, completions, **metadata)` as reward.fn would be called. A function that raises is answered 500
with its error, malformed requests 400.
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

from common.net import send_json


def reward_server(fn: Callable, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A server (not yet serving: call serve_forever) answering reward requests with `fn`."""

    class Scores(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (the stdlib's name)
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                args = (body["prompts"], body["completions"])
                metadata = body.get("metadata") or {}
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                return self._send(400, {"error": f"expected {{prompts, completions, metadata}}: {e!r}"})
            try:
                rewards = [float(r) for r in fn(*args, **metadata)]
            except Exception as e:  # noqa: BLE001 - the caller gets the function's error, the server goes on
                traceback.print_exc()
                return self._send(500, {"error": f"{type(e).__name__}: {e}"})
            self._send(200, {"rewards": rewards})

        def _send(self, status: int, body: dict) -> None:
            send_json(self, status, body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, port), Scores)
    server.daemon_threads = True
    return server


def main(argv: Optional[list[str]] = None) -> int:
    from common.errors import UserError
    from rollout.rewards import resolve_reward_fn

    parser = argparse.ArgumentParser(prog="python -m rlhf.reward_server", description=__doc__.split("\n")[0])
    parser.add_argument("--fn", required=True, help="package.module:function, or a built-in reward (math, sort)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args(argv)
    try:
        server = reward_server(resolve_reward_fn(args.fn, None), args.host, args.port)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the port is taken, or the host is not this machine's
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror}; choose another --port", file=sys.stderr)
        return 2
    print(f"serving {args.fn} at http://{args.host}:{server.server_address[1]}/score", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
