"""Agents through the rollout's OpenAI-compatible endpoint (rollout.agents.runner): the real HTTP server, the official
`openai` client, the real vLLM engine. A tool call is parsed by vLLM's parser and answered; a multi-call episode is
one sample, token-exact against the chat template and in agreement with the trainer's forward; a history rewrite is
a counted break; bad requests get OpenAI-style errors; failing agents end their own episodes."""
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from common.errors import UserError
from common.schema import AgentConfig
from rollout.agents.render import chat_ids, continuation_ids, for_template, render, same_message
from rollout.agents.runner import load_agent, reward_of
from rollout.engine import SamplingConfig
from tests.fixtures import agents as toy
from tests.fixtures.agent_model import CONVERSATION, teach_tool_call

GREEDY = SamplingConfig(max_new_tokens=96, temperature=0.0, n=2)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_load_agent_names_what_is_wrong():
    assert load_agent("tests.fixtures.agents:calculator") is toy.calculator
    for name, why in (("tests.fixtures.agents", "package.module:function"), ("nowhere.at_all:f", "cannot import"),
                      ("tests.fixtures.agents:nope", "has no 'nope'"),
                      ("tests.fixtures.agents:TOOLS", "must be a function")):
        with pytest.raises(UserError, match=why):
            load_agent(name)
    assert reward_of(1) == 1.0 and reward_of(0.25) == 0.25
    for bad in ("1.0", None, True, float("nan")):
        with pytest.raises(TypeError, match="finite number"):
            reward_of(bad)


def test_a_template_without_tools_is_told_them_in_the_hermes_format(tok):
    messages = for_template(CONVERSATION, toy.TOOLS, native_tools=False)
    assert messages[0]["role"] == "system" and '<tools>\n{"type": "function"' in messages[0]["content"]
    # the model's earlier call written as Qwen2.5's template writes it
    assert messages[2]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    assert for_template([{"role": "system", "content": "Be brief."}], toy.TOOLS, False)[0]["content"].startswith(
        "Be brief.\n\n# Tools")
    assert for_template(CONVERSATION[:1], None, False) == [CONVERSATION[0]]


def test_a_continuation_is_what_the_template_writes_after_the_reply(tok):
    close = tok.convert_tokens_to_ids("<|im_end|>")
    history, reply, new = CONVERSATION[:1], CONVERSATION[1], CONVERSATION[2:3]
    sampled = tok(for_template([reply], None, False)[0]["content"], add_special_tokens=False).input_ids
    for closed in (True, False):  # a reply cut by max_tokens did not write its <|im_end|>: the template's goes in
        context = chat_ids(tok, history, toy.TOOLS) + sampled + ([close] if closed else [])
        more = continuation_ids(tok, close, history, reply, new, toy.TOOLS, closed)
        assert context + more == chat_ids(tok, CONVERSATION[:3], toy.TOOLS)
    # a template that rewrites earlier turns cannot continue: the call is a new sample
    tok2 = type(tok).from_pretrained(tok.name_or_path)
    tok2.chat_template = ("{% for m in messages %}{{ m['content'] if loop.last else '' }}|{% endfor %}"
                          "{% if add_generation_prompt %}>{% endif %}")
    assert continuation_ids(tok2, close, history, reply, new, None, True) is None


def test_a_message_sent_back_is_recognised_whatever_the_client_wrote():
    returned = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]}
    echoed = {"role": "assistant", "content": "", "refusal": None, "tool_calls": [
        {"id": "other", "type": "function", "function": {"name": "add", "arguments": '{"b":3,"a":2}'}}]}
    assert same_message(returned, echoed)
    assert same_message({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                        {"role": "user", "content": "ab"})
    assert not same_message(returned, {**echoed, "tool_calls": [{"function": {"name": "add", "arguments": "{}"}}]})
    assert not same_message({"role": "user", "content": "a"}, {"role": "assistant", "content": "a"})


def test_a_taken_port_is_a_clear_error():
    from rollout.agents.server import AgentEndpoint
    first = AgentEndpoint(lambda *a: {}, "policy")
    try:
        with pytest.raises(UserError, match=f"agent.host/agent.port = 127.0.0.1:{first.port}: cannot listen"):
            AgentEndpoint(lambda *a: {}, "policy", port=first.port)
    finally:
        first.close()


def test_the_endpoint_answers_only_calls_that_carry_its_bearer_token():
    """With the real openai client: the run's api_key is served; none, or another one, is answered 401 before the
    request reaches the run (the endpoint may listen beyond loopback: agent.host)."""
    import openai

    from rollout.agents.server import AgentEndpoint
    seen = []
    endpoint = AgentEndpoint(lambda key, kind, body: seen.append(key) or {"object": "list", "data": []}, "policy")
    try:
        good = openai.OpenAI(base_url=endpoint.url("e1"), api_key=endpoint.token, max_retries=0)
        assert [m.id for m in good.models.list().data] == ["policy"]
        for key in ("rlhf", endpoint.token[:-1] + "x"):
            wrong = openai.OpenAI(base_url=endpoint.url("e1"), api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError, match="bearer token"):
                wrong.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        assert seen == []  # nothing unauthenticated reached the handler
        other = AgentEndpoint(lambda *a: {}, "policy")
        assert other.token != endpoint.token  # one per endpoint (per run)
        other.close()
    finally:
        endpoint.close()


def test_agent_config_is_checked_before_the_run():
    """The config's own problems when it is loaded; the agent's code and tool parser before any worker starts."""
    from rlhf.config import load_config
    from rlhf.rl.preflight import preflight
    with pytest.raises(UserError) as e:
        load_config(None, ["stage=rl", "agent.fn=tests.fixtures.agents:nope", "agent.max_calls=0",
                           "env.name=tests.fixtures.envs:Echo"])
    for said in ("agent.fn", "agent.max_calls", "set one"):
        assert said in str(e.value)
    with pytest.raises(UserError) as e:
        preflight(load_config(None, ["stage=rl", "agent.fn=tests.fixtures.agents:nope", "agent.tool_parser=nobody"]))
    for said in ("agent.fn", "has no 'nope'", "agent.tool_parser", "hermes"):
        assert said in str(e.value)


@pytest.fixture(scope="module")
def engines(ray_local, tmp_path_factory):
    """A tiny model that learned one tool-using conversation, served by the real vLLM engine."""
    from rollout.engines.vllm import VLLMEngine
    from rollout.group import RolloutGroup
    from rollout.render import PromptRenderer

    folder = teach_tool_call(str(tmp_path_factory.mktemp("agent") / "model"))
    group = RolloutGroup.create(1, dict(model_path=folder, dtype="float32", max_model_len=1024, kv_cache_mb=32),
                                engine_cls=VLLMEngine)
    yield folder, group, PromptRenderer.from_pretrained(folder)
    group.shutdown()


def _runner(engines, fn: str, **cfg):
    from rollout.agents.runner import AgentRunner
    _, group, renderer = engines
    return AgentRunner(group, renderer, AgentConfig(fn=fn, **{"timeout_s": 60.0, **cfg}), max_model_len=1024)


@pytest.mark.slow
def test_a_tool_call_is_parsed_answered_and_trained_as_one_token_exact_sample(engines):
    from transformers import AutoModelForCausalLM

    from algorithms.logprobs import token_logprobs
    from common.batch import samples_to_batch
    from tests.rollout.agreement import logprob_diff

    folder, _, renderer = engines
    runner = _runner(engines, "tests.fixtures.agents:calculator")
    try:
        samples = runner.run([{"q": "what is 2 + 3?", "answer": 5}], GREEDY)
    finally:
        runner.close()
    tok = renderer.tokenizer
    whole = tok(render(tok, CONVERSATION, toy.TOOLS, False), add_special_tokens=False).input_ids[:-1]  # less "\n"
    for s in samples:  # the agent ran the tool and the model answered with its result
        assert (s.env.reward, s.env.turns, s.env.breaks, s.env.error) == (1.0, 2, 0, False)
        assert s.prompt_ids + s.completion_ids == whole  # both calls, stitched, exactly as the template renders
        trained = [i for i, m in zip(s.completion_ids, s.completion_mask) if m]
        assert tok.decode(trained) == ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
                                       '<|im_end|>5<|im_end|>')
    batch = samples_to_batch(samples, renderer.pad_id)
    with torch.no_grad():
        lp = token_logprobs(AutoModelForCausalLM.from_pretrained(folder)(
            batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1], batch["input_ids"][:, 1:])
    assert logprob_diff(lp, batch) < 1e-3  # the engine's log-probs hold over the stitched sample


@pytest.mark.slow
def test_rewrites_breaks_bad_requests_and_failing_agents(engines, capsys):
    runner = _runner(engines, "tests.fixtures.agents:two_turns")
    try:
        kept = runner.run([{"q": "hi", "good": True}], SamplingConfig(max_new_tokens=6, temperature=1.0, n=2))
        assert all(s.env.turns == 2 and s.env.breaks == 0 and s.env.reward == 1.0 for s in kept)
        mask = kept[0].completion_mask  # sampled, then the template's turn, then sampled again
        assert mask[0] and mask[-1] and not all(mask)
        # an evaluation beside a rollout (asynchronous RL): each run's calls keep their own sampling
        greedy = SamplingConfig(max_new_tokens=6, temperature=0.0, n=1)
        alone = runner.run([{"q": "hi"}, {"q": "ho"}], greedy)
        with ThreadPoolExecutor(2) as pool:
            beside = pool.submit(runner.run, [{"q": "hi"}, {"q": "ho"}], greedy)
            rollout = pool.submit(runner.run, [{"q": "hi"}] * 4, SamplingConfig(max_new_tokens=6, temperature=1.0, n=2))
            assert len({tuple(s.completion_ids) for s in rollout.result()}) > 1  # sampled, not greedy
        assert [s.completion_ids for s in beside.result()] == [s.completion_ids for s in alone]
        runner.fn = load_agent("tests.fixtures.agents:rewriter")  # drops the reply: the second call starts over
        for s in runner.run([{"q": "hi"}], SamplingConfig(max_new_tokens=4, temperature=1.0, n=2)):
            assert s.env.breaks == 1 and s.env.turns == 2 and s.env.reward == 0.5
            (start,) = s.segments  # both contexts trained, the second a sequence of its own
            later = runner.renderer.render_text((s.prompt_ids + s.completion_ids)[start:])
            assert "fresh start<|im_end|>\n<|im_start|>assistant\n" in later
            assert sum(s.completion_mask[start - len(s.prompt_ids):]) >= 1  # the second call's sampled ids
        runner.fn, runner.cfg.max_calls = load_agent("tests.fixtures.agents:prober"), 3
        toy.SEEN.clear()
        assert runner.run([{"q": "hi"}], SamplingConfig(max_new_tokens=4, temperature=1.0, n=1))[0].env.reward == 1.0
        seen = {what: (status, code) for what, status, code in toy.SEEN if what != "more"}
        assert seen["stream"][0] == seen["n"][0] == seen["tools"][0] == seen["json"][0] == 400
        assert seen["long"] == (400, "context_length_exceeded") and seen["good"] == (200, None)
        assert seen["negative"][0] == seen["oov"][0] == 400  # (they ended the whole run before)
        assert seen["models"][1] == ["policy"] and seen["completions"][1]  # the prompt's token ids, as asked
        assert [x[1:] for x in toy.SEEN if x[0] == "more"] == [(200, None), (400, "max_calls_exceeded"),
                                                               (400, "max_calls_exceeded")]
        _failing(runner, capsys)
    finally:
        runner.close()


def _failing(runner, capsys):
    runner.cfg.max_calls, runner.cfg.timeout_s = 8, 2.0
    runner.fn = load_agent("tests.fixtures.agents:flaky")
    rows = [{"q": "a"}, {"q": "b", "explode": True}, {"q": "c", "hang": True}, {"q": "d", "text": True}]
    samples = runner.run(rows, SamplingConfig(max_new_tokens=3, temperature=1.0, n=1))
    assert [s.env.error for s in samples] == [False, True, True, True]
    assert [s.env.reward for s in samples] == [1.0, 0.0, 0.0, 0.0]
    said = capsys.readouterr().err
    assert "warning: 3 of 4 agent episodes failed" in said and "the agent's own bug" in said
    with pytest.raises(UserError, match="every agent episode \\(2\\) failed"):
        runner.run(rows[1:2], SamplingConfig(max_new_tokens=3, temperature=1.0, n=2))
    runner.fn = load_agent("tests.fixtures.agents:late")
    toy.SEEN.clear()
    with pytest.raises(UserError, match="did not return within agent.timeout_s"):
        runner.run([{"sleep": 2.5}], SamplingConfig(max_new_tokens=3, temperature=1.0, n=1))
    for _ in range(50):
        if toy.SEEN:
            break
        time.sleep(0.1)
    assert toy.SEEN == [("late", 404, "episode_ended")]  # its call came after its episode ended
    runner.fn = load_agent("tests.fixtures.agents:async_two_turns")
    assert [s.env.reward for s in runner.run([{"q": "x"}], SamplingConfig(max_new_tokens=3, n=2))] == [1.0, 1.0]


@pytest.mark.slow
def test_64_agents_at_once_some_misbehaving_finish_with_the_good_ones_all_trained(engines, capsys):
    """64 episodes at once against the endpoint, 12 of them misbehaving over raw sockets: reading the answer a few
    bytes at a time (served, just slowly), hanging up mid-request, or never reading the answer (bounded by
    agent.timeout_s). The run returns every episode, each good one trained; the bad ones are counted; two runs
    leave the process's memory and threads where one run left them."""
    import threading

    import psutil
    kinds = ["good"] * 52 + ["slow"] * 4 + ["drop"] * 4 + ["deaf"] * 4
    rows = [{"q": f"q{i}", "kind": k, "sleep": 8.0} for i, k in enumerate(kinds)]
    runner = _runner(engines, "tests.fixtures.agents:unruly", concurrency=64, timeout_s=5.0)
    sampling = SamplingConfig(max_new_tokens=3, temperature=1.0, n=1)
    me = psutil.Process()
    try:
        sizes = []
        for _ in range(3):
            samples = runner.run(rows, sampling)
            by_kind = {k: [s for s, kind in zip(samples, kinds) if kind == k] for k in set(kinds)}
            assert all(s.env.reward == 1.0 and not s.env.error and s.completion_ids for s in by_kind["good"])
            assert all(s.env.reward == 1.0 for s in by_kind["slow"])  # served, at the reader's pace
            assert all(s.env.error for s in by_kind["drop"] + by_kind["deaf"])  # ended, and only themselves
            time.sleep(4.0)  # the deaf agents' threads finish their sleep (they outlived their episodes)
            sizes.append((me.memory_info().rss, threading.active_count()))
        said = capsys.readouterr().err
        assert "8 of 64 agent episodes failed" in said
        (rss1, threads1), (_, _), (rss3, threads3) = sizes
        assert rss3 - rss1 < 64 * 2**20 and threads3 <= threads1 + 2, sizes  # flat from the second run on
    finally:
        runner.close()


@pytest.mark.slow
def test_the_endpoint_serves_curl_without_a_run(engines):
    """`python -m rlhf.agent_serve`'s loop: plain HTTP calls (what curl sends) are answered and captured."""
    import json
    import threading
    import urllib.request

    from rollout.agents.runner import AgentRunner
    _, group, renderer = engines
    runner, stop = AgentRunner(group, renderer, AgentConfig(max_calls=100), max_model_len=1024), threading.Event()

    def post(body: dict) -> dict:
        request = urllib.request.Request(runner.endpoint.url("demo") + "/chat/completions", method="POST",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {runner.endpoint.token}"})
        with urllib.request.urlopen(request) as answer:
            return json.loads(answer.read())
    try:
        with ThreadPoolExecutor(1) as pool:
            served = pool.submit(runner.serve, "demo", SamplingConfig(max_new_tokens=4, temperature=0.0), stop)
            ask = [{"role": "user", "content": "hi"}]
            first = post({"model": "policy", "messages": ask})
            assert first["object"] == "chat.completion" and first["usage"]["completion_tokens"] >= 1
            post({"model": "policy", "messages": ask + [first["choices"][0]["message"],
                                                        {"role": "user", "content": "again"}]})
            stop.set()
            episode = served.result(timeout=30)
    finally:
        runner.close()
    assert (episode.calls, len(episode.samples), episode.breaks) == (2, 1, 0)  # the second call continued the first


class RejectsOne:
    """The real engines, except that a call holding a prompt that says "reject me" fails as a request the engine
    rejects does (its actor raised): what the endpoint's checks cannot all foresee."""

    def __init__(self, group, renderer):
        self.group, self.renderer, self.calls = group, renderer, []

    @property
    def num_engines(self):
        return self.group.num_engines

    def submit(self, prompts, sampling, engines=None):
        self.calls.append(len(prompts))
        if any("reject me" in self.renderer.decode(p) for p in prompts):
            return None
        return self.group.submit(prompts, sampling, engines)

    def collect(self, submitted):
        from common.remote import WorkerDied
        if submitted is None:
            raise WorkerDied("rollout engine 0 raised ValueError: this request cannot be generated",
                             "rollout engine 0", raised=True)
        return self.group.collect(submitted)


@pytest.mark.slow
def test_a_request_the_engine_rejects_ends_its_own_episode_not_the_run(engines, capsys):
    """Four agents call at once, one with a request the engine raises for: that episode fails (counted, said once),
    the three others are trained as usual, and a call that held the bad request with good ones is redone a request
    at a time. Before, the engine's error ended the whole run."""
    from rollout.agents.runner import AgentRunner
    _, group, renderer = engines
    rejecting = RejectsOne(group, renderer)
    runner = AgentRunner(rejecting, renderer, AgentConfig(fn="tests.fixtures.agents:two_turns", timeout_s=60.0),
                         max_model_len=1024)
    try:
        rows = [{"q": "one", "good": True}, {"q": "reject me"}, {"q": "three", "good": True}, {"q": "four"}]
        samples = runner.run(rows, SamplingConfig(max_new_tokens=4, temperature=1.0, n=1))
    finally:
        runner.close()
    assert [s.env.error for s in samples] == [False, True, False, False]
    assert [s.env.reward for s in samples] == [1.0, 0.0, 1.0, 0.0]
    assert all(s.env.turns == 2 for i, s in enumerate(samples) if i != 1)
    said = capsys.readouterr().err
    assert said.count("the engine rejected one agent call") == runner.rejected == 1
    assert "warning: 1 of 4 agent episodes failed" in said
