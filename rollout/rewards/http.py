"""Rewards from a service over HTTP (`reward.url`): a sandbox that runs code, a judge, a remote reward model.

The contract, one POST per batch of `reward.url_batch` completions (`reward.url_concurrency` in flight):

    request  {"prompts": [...], "completions": ["...", ...], "metadata": {"answer": [...], ...}}
    response {"rewards": [1.0, 0.0, ...]}          one number per completion, in order

`metadata` holds the dataset's other columns, aligned with the completions, as a reward function's keyword
arguments are. A request that cannot connect, times out, or is answered 429 or 5xx is retried with exponential
backoff (`reward.url_retries` times); any other status, an answer of the wrong shape, or a reward that is not a
finite number is an error at once. The whole step's scoring shares one deadline, `reward.timeout_s`, however slowly
an answer arrives. Errors name the URL, the status and the body's start.
`python -m rlhf.reward_server --fn package.module:function` serves any reward function under this contract.
"""
from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from common.errors import UserError

BACKOFF_S = 0.5  # the first retry's wait; doubled each time


def _read_by(answer, deadline: float) -> bytes:
    """The whole answer, or TimeoutError once `deadline` passes: urlopen's timeout bounds each socket read, so a
    service that trickles its bytes would otherwise hold the step for as long as it trickles."""
    parts = []
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError("the answer was still arriving at the deadline")
        part = answer.read1(65536)
        if not part:
            return b"".join(parts)
        parts.append(part)


class HttpReward:
    """A reward function (prompts, completions, **metadata) -> rewards whose work is done at `url`."""

    def __init__(self, url: str, batch: int = 32, concurrency: int = 4, retries: int = 3, timeout_s: float = 600.0):
        self.url, self.batch, self.concurrency, self.retries, self.timeout_s = url, batch, concurrency, retries, \
            timeout_s
        self.__qualname__ = f"at reward.url = {url}"

    def __call__(self, prompts: list, completions: list[str], **metadata) -> list[float]:
        deadline = time.monotonic() + self.timeout_s
        spans = [(lo, min(lo + self.batch, len(completions))) for lo in range(0, len(completions), self.batch)]
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="reward-http") as pool:
            parts = pool.map(lambda span: self._post({
                "prompts": prompts[span[0]:span[1]], "completions": completions[span[0]:span[1]],
                "metadata": {k: v[span[0]:span[1]] for k, v in metadata.items()}}, deadline), spans)
            return [r for part in parts for r in part]

    def _post(self, body: dict, deadline: float) -> list:
        data = json.dumps(body, default=str).encode()
        why = "no attempt"
        for attempt in range(self.retries + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            request = urllib.request.Request(self.url, data=data, method="POST",
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=left) as answer:
                    return self._rewards(_read_by(answer, deadline), len(body["completions"]))
            except urllib.error.HTTPError as e:
                why = f"HTTP {e.code} {e.read()[:300].decode(errors='replace')!r}"
                if e.code != 429 and e.code < 500:
                    raise UserError(f"reward.url = {self.url} answered {why}; fix the request it rejects or the "
                                    "service") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                why = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            if attempt < self.retries:
                time.sleep(max(0.0, min(BACKOFF_S * 2 ** attempt, deadline - time.monotonic())))
        if time.monotonic() < deadline:  # the retries ran out first: say so, not the deadline
            raise UserError(f"reward.url = {self.url} gave no rewards in {attempt + 1} attempts (reward.url_retries = "
                            f"{self.retries}); last: {why}")
        raise UserError(f"reward.url = {self.url} gave no rewards within reward.timeout_s = {self.timeout_s:g} s and "
                        f"{self.retries} retries; last: {why}")

    def _rewards(self, raw: bytes, n: int) -> list:
        try:
            rewards = json.loads(raw).get("rewards")
        except (json.JSONDecodeError, AttributeError):
            rewards = None
        if not isinstance(rewards, list) or len(rewards) != n:
            got = f"{len(rewards)} rewards" if isinstance(rewards, list) else repr(raw[:200])
            raise UserError(f"reward.url = {self.url} answered {got} for {n} completions; it must answer "
                            f'{{"rewards": [...]}} with one number per completion ({n} sent)')
        bad = next((i for i, r in enumerate(rewards) if isinstance(r, bool) or not isinstance(r, (int, float))
                    or not math.isfinite(r)), None)
        if bad is not None:  # (as the agent path refuses them: a NaN would only skip the step, unexplained)
            raise UserError(f"reward.url = {self.url} answered reward {rewards[bad]!r} for completion {bad} of the "
                            f"batch; every reward must be a finite number")
        return rewards
