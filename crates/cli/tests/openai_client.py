"""Drives a running `smoe serve` with the official `openai` Python package.

Usage: python openai_client.py BASE_URL API_KEY
Models expected: `qwen3` and `mixtral` (fixture vaults). Exits non-zero on the first failure.
"""

import json
import sys

import openai
from openai import OpenAI

base, key = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
checks = []


def check(name, cond, detail=""):
    checks.append(name)
    if not cond:
        raise SystemExit(f"FAILED {name}: {detail}")


# Model listing.
models = client.models.list()
ids = sorted(m.id for m in models.data)
check("list models", ids == ["mixtral", "qwen3"], ids)
check("retrieve a model", client.models.retrieve("qwen3").id == "qwen3")

msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]

# Non-streaming with a seed, then the same request streamed: chunks reassemble to the same text.
kw = dict(model="qwen3", messages=msgs, max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
full = client.chat.completions.create(**kw)
choice = full.choices[0]
check("non-streaming shape", full.object == "chat.completion" and choice.message.role == "assistant", full)
check("finish reason", choice.finish_reason in ("stop", "length"), choice.finish_reason)
u = full.usage
check("usage adds up", u.total_tokens == u.prompt_tokens + u.completion_tokens and u.completion_tokens > 0, u)
if choice.finish_reason == "length":
    check("length means max_tokens", u.completion_tokens == 24, u)

parts, reasoning, finish, usage = [], [], None, None
stream = client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            parts.append(c.delta.content)
        r = getattr(c.delta, "reasoning_content", None)
        if r:
            reasoning.append(r)
        if c.finish_reason:
            finish = c.finish_reason
streamed = "".join(parts)
expected = choice.message.content or ""
check("stream reassembles to the non-streaming text", streamed == expected, (streamed, expected))
check("stream reasoning matches", "".join(reasoning) == (getattr(choice.message, "reasoning_content", None) or ""))
check("stream finish reason", finish == choice.finish_reason, (finish, choice.finish_reason))
check("stream usage", usage is not None and usage.completion_tokens == u.completion_tokens, usage)

# Greedy is deterministic across requests; the second request reuses the cached prefix.
g1 = client.chat.completions.create(model="qwen3", messages=msgs, max_tokens=12, temperature=0)
g2 = client.chat.completions.create(model="qwen3", messages=msgs, max_tokens=12, temperature=0)
check("greedy repeats", g1.choices[0].message.content == g2.choices[0].message.content)
cached = (g2.usage.prompt_tokens_details.cached_tokens or 0) if g2.usage.prompt_tokens_details else 0
check("prefix reuse across requests", cached > 0, g2.usage)

# A follow-up turn that sends the reply back as text extends the cached conversation.
follow = msgs + [{"role": "assistant", "content": g1.choices[0].message.content}, {"role": "user", "content": "And three more?"}]
f = client.chat.completions.create(model="qwen3", messages=follow, max_tokens=8, temperature=0)
check(
    "follow-up reuses the whole previous exchange",
    f.usage.prompt_tokens_details.cached_tokens >= g1.usage.prompt_tokens + g1.usage.completion_tokens - 1,
    (f.usage, g1.usage),
)

# Tools: the definitions reach the template (the prompt grows), history with tool calls and
# tool results is accepted, and the response is a valid completion.
tools = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
t = client.chat.completions.create(model="qwen3", messages=msgs, tools=tools, tool_choice="auto", max_tokens=8, temperature=0)
check("tools reach the template", t.usage.prompt_tokens > g1.usage.prompt_tokens + 20, (t.usage, g1.usage))
check("tool finish reason", t.choices[0].finish_reason in ("stop", "length", "tool_calls"), t.choices[0].finish_reason)
if t.choices[0].message.tool_calls:
    for call in t.choices[0].message.tool_calls:
        json.loads(call.function.arguments)
history = msgs + [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]
h = client.chat.completions.create(model="qwen3", messages=history, tools=tools, max_tokens=8, temperature=0)
check("tool results accepted", h.usage.prompt_tokens > t.usage.prompt_tokens, (h.usage, t.usage))
none = client.chat.completions.create(model="qwen3", messages=msgs, tools=tools, tool_choice="none", max_tokens=4, temperature=0)
check("tool_choice none hides tools", none.usage.prompt_tokens == g1.usage.prompt_tokens, none.usage)

# Structured output: the fixture's random weights would write anything, but a JSON schema holds
# the reply; the client's own parse() reads it into a pydantic model; a required tool call
# names an offered tool with arguments that match its parameters, streamed or not. The string
# fields are bounded so that a random model must end them.
schema = {
    "type": "object",
    "properties": {"colour": {"type": "string", "maxLength": 8}, "count": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["colour", "count"],
    "additionalProperties": False,
}
js = client.chat.completions.create(
    model="qwen3", messages=msgs, max_tokens=160, temperature=0,
    response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema, "strict": True}},
)
obj = json.loads(js.choices[0].message.content)
check("json_schema reply matches its schema", set(obj) == {"colour", "count"} and len(obj["colour"]) <= 8 and 1 <= obj["count"] <= 9, obj)
check("json_schema reply ends by itself", js.choices[0].finish_reason == "stop", js.choices[0])
# An unbounded object may outrun max_tokens on random weights: whole, it parses as an object;
# cut, it is still the start of one.
jo = client.chat.completions.create(model="qwen3", messages=msgs, max_tokens=48, temperature=0.8, seed=7, response_format={"type": "json_object"})
jc = jo.choices[0]
check("json_object reply opens an object", jc.message.content.startswith("{") and jc.finish_reason in ("stop", "length"), jc)
if jc.finish_reason == "stop":
    check("json_object reply is an object", isinstance(json.loads(jc.message.content), dict), jc)

from pydantic import BaseModel, Field


class Pick(BaseModel):
    colour: str = Field(max_length=8)
    count: int = Field(ge=1, le=9)


parsed = client.chat.completions.parse(model="qwen3", messages=msgs, max_tokens=160, temperature=0, response_format=Pick)
check("parse() gives the pydantic model", isinstance(parsed.choices[0].message.parsed, Pick), parsed.choices[0])

bounded = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time now", "parameters": {"type": "object", "properties": {}}}},
]
rq = client.chat.completions.create(model="qwen3", messages=msgs, tools=bounded, tool_choice="required", max_tokens=160, temperature=0)
calls = rq.choices[0].message.tool_calls or []
check("tool_choice required calls a tool", rq.choices[0].finish_reason == "tool_calls" and len(calls) >= 1, rq.choices[0])
for call in calls:
    args = json.loads(call.function.arguments)
    check("the call names an offered tool", call.function.name in ("get_weather", "get_time"), call)
    check("its arguments match the parameters", isinstance(args.get("city"), str) if call.function.name == "get_weather" else args == {}, call)
one = client.chat.completions.create(
    model="qwen3", messages=msgs, tools=bounded, tool_choice="required", parallel_tool_calls=False, max_tokens=160, temperature=0
)
check("parallel_tool_calls false gives one call", len(one.choices[0].message.tool_calls or []) == 1, one.choices[0])
named = client.chat.completions.create(
    model="qwen3", messages=msgs, tools=bounded, max_tokens=160, temperature=0,
    tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True,
)
deltas = [tc for chunk in named for c in chunk.choices if c.delta.tool_calls for tc in c.delta.tool_calls]
check("a named tool_choice calls that tool, streamed", [d.function.name for d in deltas if d.function.name][:1] == ["get_weather"], deltas)
try:
    client.chat.completions.create(model="qwen3", messages=msgs, tools=bounded, tool_choice={"type": "function", "function": {"name": "nope"}}, max_tokens=4)
    check("an unknown named tool is refused", False)
except openai.BadRequestError as e:
    check("an unknown named tool is refused", "nope" in str(e), e)
try:
    client.completions.create(model="qwen3", prompt="x", max_tokens=4, extra_body={"response_format": {"type": "json_object"}})
    check("a JSON response_format on completions is refused", False)
except openai.BadRequestError as e:
    check("a JSON response_format on completions is refused", "chat/completions" in str(e), e)
try:
    client.chat.completions.create(model="qwen3", messages=msgs, max_tokens=4, response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    check("a json_schema without a schema is refused", False)
except openai.BadRequestError as e:
    check("a json_schema without a schema is refused", "schema" in str(e), e)

# Content as an array of text parts, and template kwargs.
parts_msg = [{"role": "user", "content": [{"type": "text", "text": "Name three "}, {"type": "text", "text": "colours."}]}]
p1 = client.chat.completions.create(model="qwen3", messages=parts_msg, max_tokens=4, temperature=0)
p2 = client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "Name three colours."}], max_tokens=4, temperature=0)
check("text parts join", p1.choices[0].message.content == p2.choices[0].message.content and p1.usage.prompt_tokens == p2.usage.prompt_tokens)
nt = client.chat.completions.create(
    model="qwen3", messages=parts_msg, max_tokens=4, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
)
check("enable_thinking=false changes the prompt", nt.usage.prompt_tokens > p1.usage.prompt_tokens, (nt.usage, p1.usage))

# Stop strings: the text never contains them.
free = client.chat.completions.create(model="qwen3", messages=msgs, max_tokens=16, temperature=0).choices[0].message.content
if len(free) > 3:
    stop = free[2:4]
    s = client.chat.completions.create(model="qwen3", messages=msgs, max_tokens=16, temperature=0, stop=[stop])
    check("stop string", s.choices[0].finish_reason == "stop" and stop not in s.choices[0].message.content, s.choices[0])

# Completions (raw text, no template), streamed and not.
c = client.completions.create(model="qwen3", prompt="def main():", max_tokens=10, temperature=0)
check("completion", c.object == "text_completion" and c.usage.completion_tokens > 0, c)
cs = "".join(x.choices[0].text for x in client.completions.create(model="qwen3", prompt="def main():", max_tokens=10, temperature=0, stream=True) if x.choices)
check("completion stream reassembles", cs == c.choices[0].text, (cs, c.choices[0].text))

# Switching models.
m = client.chat.completions.create(model="mixtral", messages=msgs, max_tokens=4, temperature=0)
check("second model answers", m.model == "mixtral" and m.usage.completion_tokens > 0, m)
back = client.chat.completions.create(model="qwen3", messages=msgs, max_tokens=12, temperature=0)
check("switching back is consistent", back.choices[0].message.content == g1.choices[0].message.content)

# Errors come back as the client's exception types.
try:
    client.chat.completions.create(model="nope", messages=msgs)
    check("unknown model raises", False)
except openai.NotFoundError as e:
    check("unknown model is 404", e.status_code == 404 and "nope" in str(e), e)
try:
    client.chat.completions.create(model="qwen3", messages=msgs, n=2)
    check("n>1 raises", False)
except openai.BadRequestError as e:
    check("n>1 is 400", e.status_code == 400, e)
try:
    OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    check("wrong key raises", False)
except openai.AuthenticationError as e:
    check("wrong key is 401", e.status_code == 401, e)

print(f"ok: {len(checks)} checks")
