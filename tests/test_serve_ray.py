"""The server as a Ray Serve deployment on a local Ray: two replicas, each its own Model."""

import concurrent.futures
import socket

import pytest

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def ray_served(tiny):
    from dflash.serve.ray_serve import build

    bundle, _ = tiny("llama")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build({"bundle": str(bundle), "replicas": "2", "threads": "1"}), name="dflash", route_prefix="/")
        url = f"http://127.0.0.1:{port}/v1"
        yield bundle, openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_answer_concurrent_clients_like_the_runtime(ray_served):
    from dflash.runtime import Model

    bundle, client = ray_served
    name = client.models.list().data[0].id
    want = Model(bundle).generate(messages=MESSAGES, max_new_tokens=16).text

    def ask(i):
        stream = i % 2 == 1
        reply = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=16, temperature=0,
                                               stream=stream)
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
        return reply.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(ask, range(8))) == [want] * 8
    replicas = serve.status().applications["dflash"].deployments["dflash"].replica_states
    assert replicas.get("RUNNING") == 2


def test_bad_requests_get_openai_errors_through_ray(ray_served):
    _, client = ray_served
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=4)
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=4,
                                       temperature=5)


def test_the_builder_names_bad_arguments():
    from dflash.serve.ray_serve import build

    with pytest.raises(ValueError, match="bundle="):
        build({})
    with pytest.raises(ValueError, match="unknown argument.*replica"):
        build({"bundle": "x", "replica": "2"})
