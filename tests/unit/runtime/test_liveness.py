"""Which children the supervisor finds hung: engines by the proxy's word (its
epd_proxy_instance_hung_seconds), the proxy and the store by their own health URL; a
child counts only once it has answered since its start, and only past the limit."""

from __future__ import annotations

from types import SimpleNamespace

import httpx

from epd_serve.runtime.liveness import hung_children

PROXY = "http://proxy"


def child(name: str, url: str = "", healthy: bool = True, code: int | None = None):
    return SimpleNamespace(name=name, health_url=url, healthy=healthy, silent_since=None,
                           exit_code=lambda: code)


def client(hung: dict[str, float], silent: set[str]) -> httpx.Client:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.host in silent:
            raise httpx.ReadTimeout("silent", request=request)
        if request.url.path == "/metrics":
            body = "".join(f'epd_proxy_instance_hung_seconds{{instance="{n}"}} {s}\n'
                           for n, s in hung.items())
            return httpx.Response(200, text=body)
        return httpx.Response(503)  # an answer all the same: not hung

    return httpx.Client(transport=httpx.MockTransport(answer))


def test_an_engine_the_proxy_has_seen_hung_past_the_limit_is_hung():
    children = [child("p0"), child("d0"), child("e0", healthy=False)]
    found = hung_children(children, {"p0", "d0", "e0"}, PROXY,
                          client({"p0": 31.0, "d0": 12.0, "e0": 99.0}, set()), 30.0)
    assert list(found) == ["p0"] and "31 s" in found["p0"]  # e0 has not answered yet


def test_the_proxy_and_the_store_are_hung_once_silent_past_the_limit():
    children = [child("proxy", "http://proxy/health"), child("mmstore", "http://store/health")]
    silent = client({}, {"store"})
    assert hung_children(children, set(), PROXY, silent, 30.0, now=100.0) == {}
    assert hung_children(children, set(), PROXY, silent, 30.0, now=120.0) == {}
    found = hung_children(children, set(), PROXY, silent, 30.0, now=131.0)
    assert list(found) == ["mmstore"]
    # It answers again: the count starts over.
    assert hung_children(children, set(), PROXY, client({}, set()), 30.0, now=132.0) == {}
    assert children[1].silent_since is None


def test_a_proxy_that_does_not_answer_condemns_no_engine():
    children = [child("p0"), child("proxy", "http://proxy/health")]
    found = hung_children(children, {"p0"}, PROXY, client({"p0": 99.0}, {"proxy"}), 30.0)
    assert found == {}  # and the proxy itself after its own 30 s
