"""The same app under hypercorn via the ``create_app()`` factory, configured by AIOLM_* env."""

from __future__ import annotations

import shlex
import sys

import httpx
import openai
import pytest
from server_helpers import LIGHT_ENGINE_FLAGS, ServerProcess, free_port

pytest.importorskip("hypercorn")


@pytest.fixture(scope="module")
def hserver(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("hypercorn")
    port = free_port()
    cfg = tmp / "hypercorn.toml"
    # model load takes longer than hypercorn's 60 s default start-up timeout on a busy machine
    cfg.write_text(f'bind = ["127.0.0.1:{port}"]\nstartup_timeout = 600\ngraceful_timeout = 10\n')
    env = {"AIOLM_ARGS": shlex.join([*LIGHT_ENGINE_FLAGS, "--served-model-name", "smol"]), "AIOLM_API_KEY": "hk"}
    cmd = [sys.executable, "-m", "hypercorn", "aiolm.server:create_app()", "--config", str(cfg)]
    with ServerProcess(cmd, port, tmp / "server.log", env).serving("hypercorn") as srv:
        yield srv


def test_chat_and_stream_under_hypercorn(hserver):
    client = openai.OpenAI(base_url=hserver.base_url + "/v1", api_key="hk", max_retries=0, timeout=120)
    assert client.models.list().data[0].id == "smol"
    r = client.chat.completions.create(
        model="smol",
        temperature=0,
        max_tokens=8,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert "Paris" in r.choices[0].message.content
    text = ""
    usage = None
    for chunk in client.completions.create(
        model="smol", prompt="Hello", max_tokens=4, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices:
            text += chunk.choices[0].text
        usage = chunk.usage or usage
    assert text and usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt="x", top_p=7)
    assert e.value.body["param"] == "top_p"
    assert httpx.get(hserver.base_url + "/v1/models", timeout=10).status_code == 401
    assert "aiolm:num_requests_running" in httpx.get(hserver.base_url + "/metrics", timeout=10).text


def test_disconnect_under_hypercorn(hserver):
    body = {"prompt": "Tell a long story", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=hserver.base_url, headers={"authorization": "Bearer hk"}, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
        import time

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m = c.get("/metrics").text
            if (
                'aiolm:num_requests_running{engine="0",model_name="smol"} 0.0' in m
                and 'aiolm:kv_cache_usage_perc{engine="0",model_name="smol"} 0.0' in m
            ):
                break
            time.sleep(0.1)
        assert 'aiolm:num_requests_running{engine="0",model_name="smol"} 0.0' in m
        assert 'aiolm:kv_cache_usage_perc{engine="0",model_name="smol"} 0.0' in m
