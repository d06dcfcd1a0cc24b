"""Rewards over HTTP (reward.url): the reference server (rlhf.reward_server) scores batches in order; a service
that fails for a while is retried with backoff, one that keeps failing, hangs past reward.timeout_s, rejects the
request or answers the wrong shape stops the step with an error naming the URL and what it said."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from common.errors import UserError
from common.schema import RewardConfig
from rlhf.reward_server import reward_server
from rollout.rewards import reward_fn_for, score_rows
from rollout.rewards.http import HttpReward


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
        rewards = [float("nan") if what == "nan" else "high" if what == "text" else 1.0] * n
        body = json.dumps({"rewards": rewards[:n - 1] if what == "short" else rewards}
                          if what in (200, "short", "hang", "nan", "text", "trickle") else {"error": "busy"}).encode()
        self.send_response(what if isinstance(what, int) else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        for i in range(0, len(body), 1 if what == "trickle" else len(body)):  # a byte at a time, or all at once
            self.wfile.write(body[i:i + (1 if what == "trickle" else len(body))])
            self.wfile.flush()
            time.sleep(0.2 if what == "trickle" else 0.0)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("plan, retries, timeout_s, error", [
    ([503, 429, 500], 3, 30.0, None),  # retried with backoff until it answers
    ([500] * 5, 2, 30.0, "no rewards in 3 attempts \\(reward.url_retries = 2\\); last: HTTP 500 .*busy"),
    ([404], 3, 30.0, "answered HTTP 404"),  # a rejected request is not retried
    (["short"], 3, 30.0, "answered 1 rewards for 2 completions"),
    (["hang", "hang"], 1, 1.0, "within reward.timeout_s = 1 s"),
    (["trickle"], 0, 1.0, "within reward.timeout_s = 1 s"),  # each byte in time, the answer not: held 77 s before
    (["nan"], 3, 30.0, "answered reward nan for completion 0 .* must be a finite number"),  # trained nothing before
    (["text"], 3, 30.0, "answered reward 'high' for completion 0"),
])
def test_a_failing_service_is_retried_then_named(plan, retries, timeout_s, error):
    Flaky.plan, Flaky.calls, start = plan, 0, time.monotonic()
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
            assert str(e.value).count("reward.url =") == 1  # said once, not wrapped again
            assert time.monotonic() - start < timeout_s + 5
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


def test_a_reward_services_error_reaches_the_run_said_once():
    """Through the run's scoring (rollout.rewards.score): the service's own message, not wrapped in 'reward
    function ... raised UserError: reward.url = ...'."""
    Flaky.plan, Flaky.calls = ["nan"], 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    server.daemon_threads = True
    fn = reward_fn_for(RewardConfig(url=_serve(server), url_retries=0), None)
    try:
        with pytest.raises(UserError) as e:
            score_rows(fn, [{"prompt": "p", "answer": "1"}], ["a"])
        assert str(e.value).startswith("reward.url = http://127.0.0.1:") and "raised" not in str(e.value)
    finally:
        server.shutdown()
