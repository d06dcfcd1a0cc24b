"""Agents for the tests: written against the official `openai` client, as a user's agent is."""
import time

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


def two_turns(row, client):
    """Asks, sends the reply back with a follow-up, asks again: one stitched sample of two calls."""
    messages = [{"role": "user", "content": row["q"]}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    return 1.0 if row.get("good") else 0.0


def rewriter(row, client):
    """Drops the model's reply from its history before the second call: a history break."""
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["q"]}], max_tokens=4)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "fresh start"}],
                                   max_tokens=4)
    return 0.5


def calculator(row, client):
    """Offers the add tool, runs the call the model makes, sends the result back, and scores the final answer."""
    import json
    messages = [{"role": "user", "content": row["q"]}]
    reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=96)
    message = reply.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        args = json.loads(call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    final = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=8)
    return float(final.choices[0].message.content.strip() == str(row["answer"]))


async def async_two_turns(row, client):
    first = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["q"]}],
                                                 max_tokens=4)
    return float(len(first.choices[0].message.content) >= 0)


def flaky(row, client):
    """Fails the way code fails: raises, hangs, or returns something that is not a number, by row."""
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["q"]}], max_tokens=3)
    if row.get("explode"):
        raise RuntimeError("the agent's own bug")
    if row.get("hang"):
        time.sleep(30)
    if row.get("text"):
        return "correct"
    return 1.0


SEEN: list = []  # (what, HTTP status, error code) as the prober and the late agent saw them


def _status(call) -> tuple:
    import openai
    try:
        call()
        return 200, None
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        return e.status_code, body.get("code")


def prober(row, client):
    """Sends what a buggy agent sends, each answered with an OpenAI-style error, then calls that work."""
    import urllib.error
    import urllib.request
    ask = [{"role": "user", "content": row["q"]}]
    chat = client.chat.completions.create
    SEEN.append(("stream", *_status(lambda: chat(model="policy", messages=ask, stream=True))))
    SEEN.append(("n", *_status(lambda: chat(model="policy", messages=ask, n=2))))
    SEEN.append(("long", *_status(lambda: chat(model="policy", messages=[{"role": "user", "content": "7 " * 600}]))))
    SEEN.append(("tools", *_status(lambda: chat(model="policy", messages=ask, tools=[{"type": "function"}]))))
    bad = urllib.request.Request(f"{client.base_url}chat/completions", data=b"{not json", method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(bad)
        SEEN.append(("json", 200, None))
    except urllib.error.HTTPError as e:
        SEEN.append(("json", e.code, None))
    SEEN.append(("models", 200, [m.id for m in client.models.list().data]))
    # what the engine would refuse for the whole call it joins: answered 400 here, the run and other episodes go on
    SEEN.append(("negative", *_status(lambda: chat(model="policy", messages=ask, max_tokens=-1))))
    SEEN.append(("oov", *_status(lambda: client.completions.create(model="policy", prompt=[5, 10 ** 7], max_tokens=2))))
    SEEN.append(("good", *_status(lambda: chat(model="policy", messages=ask, max_tokens=3))))
    text = client.completions.create(model="policy", prompt="12", max_tokens=3, extra_body={"return_token_ids": True})
    SEEN.append(("completions", 200, text.model_extra.get("prompt_token_ids")))
    for _ in range(3):  # agent.max_calls = 3: the third call of the episode is the last one served
        SEEN.append(("more", *_status(lambda: chat(model="policy", messages=ask, max_tokens=2))))
    return 1.0


def late(row, client):
    """Calls after its episode's deadline: answered 404, never generated."""
    time.sleep(row["sleep"])
    SEEN.append(("late", *_status(lambda: client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2))))
    return 1.0


def sort_afresh(row, client):
    """The sort question asked twice, each time in a fresh conversation: a history break in every episode."""
    from rollout.rewards import sort_reward
    score = 0.0
    for _ in range(2):
        message = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": row["question"]}]).choices[0].message
        score += 0.5 * sort_reward([row["question"]], [message.content], answer=[row["answer"]])[0]
    return score


def sort_twice(row, client):
    """tests.envs.toy:SortTwice as an agent: the sort question, the reply sent back with "again", the mean score."""
    from rollout.rewards import sort_reward
    messages, score = [{"role": "user", "content": row["question"]}], 0.0
    for _ in range(2):
        message = client.chat.completions.create(model="policy", messages=messages).choices[0].message
        score += 0.5 * sort_reward([row["question"]], [message.content], answer=[row["answer"]])[0]
        messages += [message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    return score
