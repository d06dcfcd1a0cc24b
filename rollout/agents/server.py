"""The rollout's OpenAI-compatible HTTP endpoint: `/<episode>/v1/chat/completions`, `/<episode>/v1/completions` and
`/<episode>/v1/models`, one URL prefix per agent episode so that every call is captured into its own episode.

Requests are validated by vLLM's own OpenAI protocol models; a bad one (malformed JSON, an unknown field type,
`stream` or `n` > 1, a context longer than `rollout.max_model_len`, a call past `agent.max_calls`, an episode that
has ended) is answered with an OpenAI-style error (`{"error": {"message", "type", "param", "code"}}`, 4xx), never
passed to the engine. The stdlib's threading server: each call waits on its own thread while the runner batches
the calls of all episodes into engine calls (rollout.agents.runner).

Every request must carry the endpoint's bearer token (`Authorization: Bearer <token>`, what the OpenAI client sends
for its `api_key`): a token per run, so that an endpoint reachable from other nodes (agent.host) serves only the
run's own agents; a request without it is answered 401 before anything else is read.
"""
from __future__ import annotations

import hmac
import json
import secrets
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

from common.errors import UserError
from common.net import send_json


class ApiError(Exception):
    """An OpenAI-style error answer: HTTP `status`, a message saying what to change, and its `code`."""

    def __init__(self, status: int, message: str, code: Optional[str] = None, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # the stdlib's 5 resets connections when a step's agents all call at once
    daemon_threads = True


Handler = Callable[[str, str, dict], dict]  # (episode key, "chat" | "completions", request body) -> response body


class AgentEndpoint:
    """Serves `handle(key, kind, body)` on `host:port` (0: a free port) from a daemon thread until `close`."""

    def __init__(self, handle: Handler, model: str, host: str = "127.0.0.1", port: int = 0,
                 token: Optional[str] = None):
        """`token`: the bearer token every request must carry (None: a new random one, `self.token`)."""
        endpoint = self

        class _Requests(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: the openai client reuses its connection

            def do_POST(self):  # noqa: N802 (the stdlib's name)
                endpoint._answer(self, "POST")

            def do_GET(self):  # noqa: N802
                endpoint._answer(self, "GET")

            def log_message(self, *args):  # one line per call on stderr would drown the run's console
                pass

        self.handle, self.model = handle, model
        self.token = token or secrets.token_urlsafe(24)
        try:
            self.server = _Server((host, port), _Requests)
        except OSError as e:  # the port is taken, or the host is not this machine's
            raise UserError(f"agent.host/agent.port = {host}:{port}: cannot listen there ({e.strerror}); choose "
                            "another port (0: any free one)") from None
        self.host, self.port = host, self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="agent-endpoint", daemon=True)
        self.thread.start()

    def url(self, key: str) -> str:
        """The base URL an OpenAI client of episode `key` uses (`openai.OpenAI(base_url=...)`)."""
        return f"http://{self.host}:{self.port}/{key}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _answer(self, req: BaseHTTPRequestHandler, method: str) -> None:
        try:
            status, body = HTTPStatus.OK, self._route(req, method)
        except ApiError as e:
            status, body = e.status, e.body()
        except Exception as e:  # a bug here must not kill the server thread or hang the agent: a 500 it can log
            status, body = 500, ApiError(500, f"{type(e).__name__}: {e}").body()
        send_json(req, status, body)

    def _route(self, req: BaseHTTPRequestHandler, method: str) -> dict:
        given = req.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            raise ApiError(401, "missing or wrong bearer token: call with the api_key the run gave this agent (its "
                                "OpenAI client's api_key; rlhf.agent_serve prints it)", code="invalid_api_key")
        parts = req.path.split("?", 1)[0].strip("/").split("/")
        if len(parts) < 3 or parts[1] != "v1":
            raise ApiError(404, f"no route {req.path}: use the base URL the agent was given, <host>/<episode>/v1")
        key, route = parts[0], "/".join(parts[2:])
        if method == "GET" and route == "models":
            return {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "rlhf"}]}
        if method != "POST" or route not in ("chat/completions", "completions"):
            raise ApiError(404, f"no route {method} /v1/{route}: this endpoint serves POST /v1/chat/completions, "
                                "POST /v1/completions and GET /v1/models")
        length = int(req.headers.get("Content-Length") or 0)
        try:
            body = json.loads(req.rfile.read(length) or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return self.handle(key, "chat" if route == "chat/completions" else "completions", body)


def completion_body(kind: str, model: str, message_or_text, finish: str, prompt_len: int, ids: list[int],
                    logprobs: Optional[list[dict]], prompt_ids: Optional[list[int]]) -> dict:
    """An OpenAI response: a chat.completion (`message_or_text` a message dict) or a text_completion (a string),
    with vLLM's extensions: the prompt's and the choice's token ids when the request asked (`return_token_ids`)."""
    choice: dict = {"index": 0, "finish_reason": finish}
    if kind == "chat":
        choice["message"] = message_or_text
        choice["logprobs"] = None if logprobs is None else {"content": logprobs}
    else:
        choice["text"] = message_or_text
        choice["logprobs"] = None if logprobs is None else {
            "tokens": [x["token"] for x in logprobs], "token_logprobs": [x["logprob"] for x in logprobs]}
    if prompt_ids is not None:
        choice["token_ids"] = ids
    body = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": {"prompt_tokens": prompt_len, "completion_tokens": len(ids),
                      "total_tokens": prompt_len + len(ids)}}
    if prompt_ids is not None:
        body["prompt_token_ids"] = prompt_ids
    return body
