"""Rewards over HTTP (reward.url): the reference server (rlhf.reward_server) scores batches in order; a service
that fails for a while is retried with backoff, one that keeps failing, hangs past reward.timeout_s, rejects the
request or answers the wrong shape stops the step with an error naming the URL and what it said."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from common.errors import UserError
from common.options import RewardConfig
from rlhf.reward_server import reward_server
from rollout.reward_http import HttpReward
from rollout.rewards import reward_fn_for, score_rows


def _serve(server):
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/score"


def length_reward(prompts, completions, answer, **_):
    """A reward that reads a metadata column: 1 when the completion has the answer's length."""
    if "boom" in completions:
        raise ValueError("cannot score boom")
    return [float(len(c) == int(a)) for c, a in zip(completions, answer)]


def test_the_reference_server_scores_batches_in_order():
    server = reward_server(length_reward)
    url = _serve(server)
    try:
        rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i % 4)} for i in range(70)]
        completions = ["x" * (i % 3) for i in range(70)]
        fn = reward_fn_for(RewardConfig(url=url, url_batch=32, url_concurrency=3), None)
        assert score_rows(fn, rows, completions) == [float(i % 3 == i % 4) for i in range(70)]  # 3 requests
        with pytest.raises(UserError, match="HTTP 500.*cannot score boom"):  # the function's error, not retried
            HttpReward(url, retries=0)(["p"], ["boom"], answer=["1"])
    finally:
        server.shutdown()


class Flaky(BaseHTTPRequestHandler):
    """Answers `plan` in turn: an HTTP status, "hang", or "short" (one reward too few); then rewards of 1."""
    plan: list = []
    calls = 0

    def do_POST(self):  # noqa: N802
        n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["completions"])
        what = Flaky.plan[Flaky.calls] if Flaky.calls < len(Flaky.plan) else 200
        Flaky.calls += 1
        if what == "hang":
            time.sleep(3)
        body = json.dumps({"rewards": [1.0] * (n - 1 if what == "short" else n)} if what in (200, "short", "hang")
                          else {"error": "busy"}).encode()
        self.send_response(what if isinstance(what, int) else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("plan, retries, timeout_s, error", [
    ([503, 429, 500], 3, 30.0, None),  # retried with backoff until it answers
    ([500] * 5, 2, 30.0, "2 retries; last: HTTP 500 .*busy"),
    ([404], 3, 30.0, "answered HTTP 404"),  # a rejected request is not retried
    (["short"], 3, 30.0, "one number per completion \\(2 sent\\)"),
    (["hang", "hang"], 1, 1.0, "within reward.timeout_s = 1 s"),
])
def test_a_failing_service_is_retried_then_named(plan, retries, timeout_s, error):
    Flaky.plan, Flaky.calls = plan, 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    server.daemon_threads = True
    fn = HttpReward(_serve(server), retries=retries, timeout_s=timeout_s)
    try:
        if error is None:
            assert fn(["p", "q"], ["a", "b"]) == [1.0, 1.0] and Flaky.calls == 4
        else:
            with pytest.raises(UserError, match=error) as e:
                fn(["p", "q"], ["a", "b"])
            assert "reward.url = http://127.0.0.1:" in str(e.value)
    finally:
        server.shutdown()


def test_reward_url_is_checked_with_the_config():
    from rlhf.config import load_config
    with pytest.raises(UserError) as e:
        load_config(None, ["stage=rl", "reward.url=ftp://x", "reward.url_batch=0", "data.task=sort"])
    assert "reward.url" in str(e.value) and "reward.url_batch" in str(e.value)


def test_the_reward_server_command_says_what_is_wrong(capsys):
    from rlhf.reward_server import main
    assert main(["--fn", "nowhere.at_all:f"]) == 2
    assert "cannot import module 'nowhere.at_all'" in capsys.readouterr().err
    taken = reward_server(length_reward)
    try:
        assert main(["--fn", "math", "--port", str(taken.server_address[1])]) == 2
        assert "choose another --port" in capsys.readouterr().err
    finally:
        taken.server_close()
