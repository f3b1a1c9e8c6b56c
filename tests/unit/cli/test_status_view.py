"""`epd-serve status`: the instance table rendered from /status, and the command
against a live HTTP server, a server that answers nonsense and a closed port."""

from __future__ import annotations

import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from rich.console import Console

from epd_serve.cli import main as cli
from epd_serve.cli.status_view import render

LONG_ERROR = "HTTP 500: " + "engine exploded while prefilling the request " * 5

SAMPLE = {
    "model": "tiny",
    "policies": {"E": "hash-affinity", "P": "least-loaded", "D": "least-loaded"},
    "instances": [
        {"name": "e0", "roles": "E", "url": "http://127.0.0.1:8100", "source": "config",
         "healthy": True, "draining": False, "probe_failures": 0, "in_flight": 2,
         "in_flight_cost": 150000.0, "served": 120, "failures": 1, "last_error": None,
         "engine": {"running": 1, "waiting": 0, "kv_cache_usage": 0.12}},
        {"name": "p1", "roles": "P", "url": "http://127.0.0.1:8101", "source": "registered",
         "healthy": False, "draining": False, "probe_failures": 3, "in_flight": 0,
         "served": 7, "failures": 4, "last_error": LONG_ERROR, "engine": None,
         "a_field_from_a_newer_proxy": {"x": 1}},
        {"name": "d2", "roles": "D", "url": "http://127.0.0.1:8102", "source": "config",
         "healthy": True, "draining": True, "in_flight": 5, "served": 33, "failures": 0,
         "engine": {"running": 5, "waiting": 2, "kv_cache_usage": 0.875}},
        {"name": "x3"},  # every other field missing
    ],
}


def text_of(status: dict, width: int = 160) -> str:
    console = Console(record=True, width=width)
    console.print(render(status, width))
    return console.export_text()


def row(text: str, name: str) -> str:
    (line,) = [ln for ln in text.splitlines() if f" {name} " in ln]
    return line


def cells(line: str) -> list[str]:
    # Columns are at least three spaces apart; values hold single spaces at most.
    return re.split(r"\s{2,}", line.strip())


def test_table_shows_each_instance():
    text = text_of(SAMPLE)
    assert "model tiny" in text
    assert "E: hash-affinity, P: least-loaded, D: least-loaded" in text
    header = next(ln for ln in text.splitlines() if "name" in ln and "roles" in ln)
    for column in ("url", "source", "health", "in flight", "served", "failures", "running",
                   "waiting", "KV %", "last error"):
        assert column in header
    assert cells(row(text, "e0")) == [
        "e0", "E", "http://127.0.0.1:8100", "config", "up", "2", "120", "1", "1", "0", "12%", "-"]
    p1 = cells(row(text, "p1"))
    assert p1[:5] == ["p1", "P", "http://127.0.0.1:8101", "registered", "DOWN"]
    assert p1[5:11] == ["0", "7", "4", "-", "-", "-"]  # no engine metrics
    # The long error is cut to the room the other columns leave it on one line.
    assert p1[11].startswith("HTTP 500: engine exploded") and p1[11].endswith("…")
    assert LONG_ERROR not in text
    # Draining wins over healthy.
    assert cells(row(text, "d2"))[4:11] == ["draining", "5", "33", "0", "5", "2", "88%"]
    assert cells(row(text, "x3")) == ["x3"] + ["-"] * 11
    assert "a_field_from_a_newer_proxy" not in text


def test_error_is_cut_to_fit_the_terminal():
    for width in (150, 160, 200):
        lines = text_of(SAMPLE, width).splitlines()
        assert max(len(line.rstrip()) for line in lines) <= width
        assert "DOWN" in row("\n".join(lines), "p1")  # no other column was cropped
    wide = cells(row(text_of(SAMPLE, 300), "p1"))[11]
    assert len(wide) == 48 and wide.endswith("…")  # never longer than the cap
    # Without a width (a caller that does not know it) the cap alone applies.
    console = Console(record=True, width=400)
    console.print(render(SAMPLE))
    assert len(cells(row(console.export_text(), "p1"))[11]) == 48


def test_health_colours():
    console = Console(record=True, width=160, color_system="truecolor", force_terminal=True)
    console.print(render(SAMPLE, 160))
    styled = console.export_html(inline_styles=True)
    assert "#008000\">up" in styled  # green
    assert "#800000; text-decoration-color: #800000; font-weight: bold\">DOWN" in styled
    assert "#808000\">draining" in styled  # yellow


@pytest.mark.parametrize("status", [{}, {"instances": None}, {"instances": ["junk", 3]},
                                    {"model": None, "policies": "odd", "instances": []}])
def test_odd_answers_render_an_empty_table(status):
    text = text_of(status)
    assert "model -" in text and "name" in text


class StatusHandler(BaseHTTPRequestHandler):
    body = json.dumps(SAMPLE).encode()

    def do_GET(self):
        if self.path != "/status":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    def serve(body: bytes = StatusHandler.body):
        handler = type("Handler", (StatusHandler,), {"body": body})
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}"

    servers: list[ThreadingHTTPServer] = []
    yield serve
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def test_cli_renders_the_live_table(server, capsys):
    assert cli.main(["status", "--url", server()]) == 0
    out = capsys.readouterr().out
    assert "hash-affinity" in out and "http://127.0.0.1:8101" in out and "draining" in out


def test_cli_json_prints_the_raw_answer(server, capsys):
    assert cli.main(["status", "--url", server() + "/", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == SAMPLE


def test_cli_finds_the_proxy_through_a_deployment_file(server, capsys, monkeypatch):
    url = server()

    class Resolved:
        proxy_url = url

        class config:  # noqa: N801  (the deployment file's fields used by status)
            class proxy:  # noqa: N801
                api_key_env = None

    from epd_serve.runtime import bringup
    seen = []
    monkeypatch.setattr(bringup, "load", lambda path: seen.append(path) or Resolved())
    assert cli.main(["status", "configs/cpu/e-p-d.yaml"]) == 0
    assert seen == ["configs/cpu/e-p-d.yaml"] and "e0" in capsys.readouterr().out


def test_cli_derives_the_url_from_a_real_deployment_file():
    from epd_serve.runtime import bringup
    args = cli.build_parser().parse_args(["status", "configs/cpu/e-p-d.yaml"])
    assert cli._status_target(args) == (bringup.load("configs/cpu/e-p-d.yaml").proxy_url, None)
    args = cli.build_parser().parse_args(["status"])
    assert cli._status_target(args)[0] == "http://127.0.0.1:8000"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_against_a_closed_port_fails_with_one_line(capsys):
    url = f"http://127.0.0.1:{closed_port()}"
    assert cli.main(["status", "--url", url]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith(f"epd-serve: error: cannot reach the proxy at {url}/status")
    assert "Traceback" not in captured.err


def test_cli_against_a_server_that_is_not_the_proxy(server, capsys):
    assert cli.main(["status", "--url", server(b"<html>hello</html>")]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert "did not answer JSON" in line


@pytest.mark.parametrize("argv, message", [
    (["status", "configs/cpu/e-p-d.yaml", "--url", "http://x"], "not both"),
    (["status", "--url", "http://x", "--watch", "0"], "positive"),
    (["status", "no/such/file.yaml"], "not found"),
])
def test_cli_usage_errors(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_watch_refreshes_until_interrupted(server, monkeypatch, capsys):
    url = server()
    calls = []
    real_fetch = cli.fetch_status

    def fetch(base, api_key=None):
        calls.append(base)
        return real_fetch(base, api_key)

    def sleep(seconds):
        assert seconds == 0.5
        if len(calls) >= 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(cli, "fetch_status", fetch)
    monkeypatch.setattr("time.sleep", sleep)
    assert cli.main(["status", "--url", url, "--watch", "0.5"]) == 0
    assert len(calls) == 3
    assert "every 0.5 s; Ctrl-C stops" in capsys.readouterr().out


def test_cli_watch_keeps_the_last_table_while_the_proxy_is_away(monkeypatch, capsys):
    answers = [SAMPLE, cli.ProxyUnreachable("cannot reach the proxy at http://p/status: refused")]

    def fetch(base, api_key=None):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def sleep(seconds):
        if not answers:
            raise KeyboardInterrupt

    monkeypatch.setattr(cli, "fetch_status", fetch)
    monkeypatch.setattr("time.sleep", sleep)
    assert cli.main(["status", "--url", "http://p", "--watch", "2"]) == 0
    out = capsys.readouterr().out
    assert "cannot reach the proxy at http://p/status: refused; showing the last answer" in out
    assert "http://127.0.0.1:8101" in out.rsplit("showing the last answer", 1)[0]


def test_switchable_instances_show_where_they_started_and_where_they_are_going():
    status = {"instances": [
        {"name": "e0", "roles": "D", "started_as": "E", "switchable": True, "healthy": True},
        {"name": "p1", "roles": "P", "started_as": "P", "switchable": True,
         "switching_to": "D", "healthy": True},
        {"name": "d2", "roles": "D", "started_as": "D", "switchable": True, "healthy": True},
        {"name": "d3", "roles": "D", "started_as": "D", "switchable": False, "healthy": True}]}
    text = text_of(status)
    assert "D~ (was E)" in text and "P~ -> D" in text
    assert re.search(r"d2\s+D~\s", text) and re.search(r"d3\s+D\s", text)
