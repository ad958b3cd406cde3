"""dflash-serve through the official `openai` client, on a tiny bundle."""

import json
import os
import threading
import time

import http.client
import pytest
from urllib.parse import urlparse

openai = pytest.importorskip("openai")


class Raw:
    """Plain HTTP to the server (stdlib): malformed bodies, held-open streams."""

    def __init__(self, url: str):
        parts = urlparse(url)
        self.host, self.port, self.base = parts.hostname, parts.port, parts.path

    def post(self, path: str, body):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        data = body if isinstance(body, str) else json.dumps(body)
        conn.request("POST", self.base + path, data, {"Content-Type": "application/json"})
        response = conn.getresponse()
        payload = json.loads(response.read() or b"null")
        conn.close()
        return response.status, response.headers, payload  # headers: case-insensitive

    def get(self, path: str) -> dict:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        conn.request("GET", self.base + path)
        payload = json.loads(conn.getresponse().read())
        conn.close()
        return payload

    def open_stream(self, path: str, body: dict):
        """A streamed response with its first event read; close the connection to hang up."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        conn.request("POST", self.base + path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data: ")
        return conn


def start_server(app):
    import socket

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}/v1"


@pytest.fixture(scope="module")
def served(tiny):
    from dflash.serve.app import create_app

    bundle, _ = tiny("llama")
    server, thread, url = start_server(create_app(bundle, workers=2, max_waiting=16, threads=1))
    yield bundle, url, openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    server.should_exit = True
    thread.join()


MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


def test_chat_equals_the_runtime_and_streams_the_same_text(served):
    from dflash.runtime import Model

    bundle, _, client = served
    name = client.models.list().data[0].id
    want = Model(bundle).generate(messages=MESSAGES, max_new_tokens=24)
    got = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=24, temperature=0)
    assert got.choices[0].message.content == want.text
    assert got.usage.completion_tokens == len(want.tokens)
    assert got.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    pieces = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == want.text
    drafted = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=24, temperature=0,
                                             extra_body={"drafter": "lookup"})
    assert drafted.choices[0].message.content == want.text


def test_completions_and_seeded_sampling(served):
    from dflash.runtime import Model

    bundle, _, client = served
    name = client.models.list().data[0].id
    want = Model(bundle).generate(prompt="a cache holds", max_new_tokens=20)
    assert client.completions.create(model=name, prompt="a cache holds", max_tokens=20,
                                     temperature=0).choices[0].text == want.text
    sampled = [client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=20, temperature=0.9,
                                              seed=7).choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1]


@pytest.mark.parametrize("body, status, words", [
    ("{not json", 400, "not valid JSON"),
    ({"model": "nope", "messages": MESSAGES}, 404, "does not exist"),
    ({"model": None, "messages": MESSAGES, "temperature": 5}, 422, "temperature"),
    ({"model": None, "messages": []}, 422, "messages"),
    ({"model": None, "messages": MESSAGES, "drafter": "eagle9"}, 400, "no drafter 'eagle9'"),
    ({"model": None, "messages": [{"role": "user", "content": "fox " * 400}]}, 400, "re-export with a larger --max-len"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served, body, status, words):
    _, url, client = served
    name = client.models.list().data[0].id
    if isinstance(body, dict):
        body = json.dumps({**body, "model": body["model"] or name})
    code, _, payload = Raw(url).post("/chat/completions", body)
    assert code == status
    assert words in payload["error"]["message"]
    assert client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=4).choices[0].finish_reason


def test_a_full_queue_gets_429_and_a_disconnect_frees_the_worker(tiny):
    from dflash.serve.app import create_app

    bundle, _ = tiny("llama")
    server, thread, url = start_server(create_app(bundle, workers=1, max_waiting=0, threads=1))
    try:
        raw = Raw(url)
        name = raw.get("/models")["data"][0]["id"]
        body = {"model": name, "messages": MESSAGES, "max_tokens": 120, "stream": True}
        held = raw.open_stream("/chat/completions", body)  # holds the only worker, reading nothing more
        code, headers, payload = raw.post("/chat/completions", {**body, "stream": False})
        assert code == 429 and headers["Retry-After"] == "1" and payload["error"]["type"] == "rate_limit_error"
        held.close()
        deadline = time.time() + 10  # the dropped stream stops at its next piece
        while True:
            code, _, _ = raw.post("/chat/completions", {**body, "stream": False, "max_tokens": 5})
            if code == 200 or time.time() > deadline:
                break
            time.sleep(0.05)
        assert code == 200
    finally:
        server.should_exit = True
        thread.join()


def test_load_mixed_clients_leave_no_trace(served):
    """8 clients x 12 requests (3 rounds of plain, streamed, cancelled mid-stream, malformed). Every
    well-formed one gets the right text; RSS and open files return to their level."""
    from dflash.runtime import Model

    bundle, url, client = served
    name = client.models.list().data[0].id
    want = Model(bundle).generate(messages=MESSAGES, max_new_tokens=16).text

    def rss_and_files():
        status = open("/proc/self/status").read()
        rss = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
        return rss, len(os.listdir("/proc/self/fd"))

    def one_round():
        got = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=16, temperature=0)
        assert got.choices[0].message.content == want
        stream = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=16, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
        raw = Raw(url)
        raw.open_stream("/chat/completions", {"model": name, "messages": MESSAGES, "max_tokens": 60,
                                              "stream": True}).close()  # hangs up after the first event
        assert raw.post("/chat/completions", "{")[0] == 400

    def one_client(i, failures, rounds=3):
        try:
            for _ in range(rounds):
                one_round()
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(f"client {i}: {e!r}")

    one_client(-1, [], rounds=1)  # warm-up: sessions, pools, the client's connections
    time.sleep(0.5)
    before = rss_and_files()
    failures: list[str] = []
    threads = [threading.Thread(target=one_client, args=(i, failures)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    time.sleep(1.0)
    after = rss_and_files()
    assert after[1] <= before[1] + 2, (before, after)  # open files (the client's pooled sockets may vary by 1-2)
    assert after[0] <= before[0] * 1.05 + 4096, (before, after)


def test_answer_memory_serves_suffix_on_a_bundle_without_a_corpus(tiny):
    """`--answer-memory` reaches every worker's Model: `suffix` is then served on a bundle with no
    corpus, and a repeated request answers the same."""
    from dflash.runtime import Model
    from dflash.serve.app import create_app

    bundle, _ = tiny("llama")
    with pytest.raises(ValueError, match="no drafter 'suffix'"):
        create_app(bundle, drafter="suffix")
    server, thread, url = start_server(create_app(bundle, drafter="suffix", threads=1, answer_memory=1024))
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        name = client.models.list().data[0].id
        want = Model(bundle).generate(messages=MESSAGES, max_new_tokens=24).text
        for _ in range(2):
            got = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=24, temperature=0)
            assert got.choices[0].message.content == want
    finally:
        server.should_exit = True
        thread.join()
