"""Drives a running `smoe serve` through Anthropic's Messages API with the official `anthropic`
Python package. Usage: python anthropic_client.py BASE_URL API_KEY (model `qwen3` expected)."""

import sys

import anthropic

base, key = sys.argv[1], sys.argv[2]
client = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)
checks = []


def check(name, cond, detail=""):
    checks.append(name)
    if not cond:
        raise SystemExit(f"FAILED {name}: {detail}")


kw = dict(model="qwen3", max_tokens=16, system="You are terse.", messages=[{"role": "user", "content": "Name three colours."}], extra_body={"temperature": 0})
msg = client.messages.create(**kw)
check("message shape", msg.type == "message" and msg.role == "assistant" and msg.content, msg)
text = "".join(b.text for b in msg.content if b.type == "text")
check("stop reason", msg.stop_reason in ("end_turn", "max_tokens"), msg.stop_reason)
check("usage", msg.usage.output_tokens > 0 and msg.usage.input_tokens > 0, msg.usage)

# The streaming event sequence, through the SDK's own accumulator.
events = []
with client.messages.stream(**kw) as s:
    for e in s:
        events.append(e.type)
    final = s.get_final_message()
streamed = "".join(b.text for b in final.content if b.type == "text")
check("stream text equals non-streaming text", streamed == text, (streamed, text))
check("stream starts and ends right", events[0] == "message_start" and events[-1] == "message_stop", events)
check("stream has block events", "content_block_start" in events and "content_block_stop" in events and "message_delta" in events, events)
check("stream stop reason", final.stop_reason == msg.stop_reason, (final.stop_reason, msg.stop_reason))

# Tools and a tool_result turn are accepted.
tools = [{"name": "get_weather", "description": "Weather for a city", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
t = client.messages.create(**kw, tools=tools)
check("tools reach the template", t.usage.input_tokens > msg.usage.input_tokens + 20, (t.usage, msg.usage))
history = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"}]},
]
r = client.messages.create(model="qwen3", max_tokens=8, messages=history, tools=tools, extra_body={"temperature": 0})
check("tool_result turn answers", r.usage.output_tokens > 0, r)

# A required tool use (tool_choice any, or the tool named): a tool_use block with input that
# matches the schema, stop_reason tool_use (the schema's string bounded so random weights end it).
bounded = [{"name": "get_weather", "description": "Weather for a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}]
for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}):
    u = client.messages.create(model="qwen3", max_tokens=160, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                               tools=bounded, tool_choice=choice, extra_body={"temperature": 0})
    uses = [b for b in u.content if b.type == "tool_use"]
    check(f"tool_choice {choice['type']} gives a tool_use", u.stop_reason == "tool_use" and len(uses) >= 1, u)
    check(f"tool_choice {choice['type']} input matches", uses[0].name == "get_weather" and isinstance(uses[0].input.get("city"), str), uses)
    if choice.get("disable_parallel_tool_use"):
        check("disable_parallel_tool_use gives one tool_use", len(uses) == 1, uses)

# Stop sequences report which one matched.
if len(text) > 3:
    stop = text[2:4]
    s = client.messages.create(**{**kw, "stop_sequences": [stop]})
    check("stop_sequence", s.stop_reason == "stop_sequence" and s.stop_sequence == stop, (s.stop_reason, s.stop_sequence))

try:
    client.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    check("unknown model raises", False)
except anthropic.NotFoundError as e:
    check("unknown model is 404", e.status_code == 404, e)
try:
    client.messages.create(model="qwen3", max_tokens=4, messages=[{"role": "robot", "content": "x"}])
    check("bad role raises", False)
except anthropic.BadRequestError as e:
    check("bad role is 400", e.status_code == 400, e)

print(f"ok: {len(checks)} checks")
