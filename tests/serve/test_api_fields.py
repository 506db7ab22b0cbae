"""The fields that change what a request computes, through the real `openai` client,
each the same with speculation on and off:

- logprobs: each committed token's log-probability under the target's distribution for
  its position (after the request's sampling warps), equal to the target's own
  log-softmax computed token by token here, streamed or whole;
- presence / frequency / repetition penalties and logit_bias (greedy: token-identical);
- bad values get a 400 naming the field."""
from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from hetero_sd.backends.registry import discover
from hetero_sd.ir import load_model_ir
from hetero_sd.sampling import SamplingParams, warp

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "the cat sat on the mat. " * 6  # repetitive: the n-gram drafter proposes
TOP = 3


@pytest.fixture(scope="module")
def clients(server, start_server, serve_config):
    plain = start_server(serve_config, "--no-speculation")
    make = lambda srv: openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=60)  # noqa: E731
    return make(server), make(plain)


@pytest.fixture(scope="module")
def start_server():  # module-scoped: one target-only server for these tests
    from helpers.serving import ServerProcess

    started = []
    yield lambda config, *args: started.append(ServerProcess(config, *args)) or started[-1]
    for srv in started:
        srv.stop()


def _completion(client, stream: bool, **sampling):
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, logprobs=TOP, stream=stream,
                                     **(sampling or {"temperature": 0}))
    if not stream:
        lp = resp.choices[0].logprobs
        return resp.choices[0].text, lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    text, tokens, values, tops, offsets = "", [], [], [], []
    for chunk in resp:
        for c in chunk.choices:
            text += c.text or ""
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
                tops += c.logprobs.top_logprobs
                offsets += c.logprobs.text_offset
    return text, tokens, values, tops, offsets


def _chat(client, stream: bool):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=20, temperature=0,
                  logprobs=True, top_logprobs=TOP, stream=stream)
    resp = client.chat.completions.create(**kwargs)
    if not stream:
        return [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs])
                for c in resp.choices[0].logprobs.content]
    out = []
    for chunk in resp:
        for c in chunk.choices:
            if c.logprobs is not None:
                out += [(x.token, x.logprob, [(t.token, t.logprob) for t in x.top_logprobs]) for x in c.logprobs.content]
    return out


def _target_rows(tiny_model_dir, prompt_ids, output_ids):
    """The target's own logits for each output position, one token per call (torch fp32, as served)."""
    runner = discover().get("torch").load(load_model_ir(tiny_model_dir("llama")), "cpu", "fp32", 1 << 20)
    seq = runner.allocate(len(prompt_ids) + len(output_ids) + 1)
    rows = [runner.forward(seq, prompt_ids, 0, 1)[0]]
    for i, tok in enumerate(output_ids[:-1]):
        rows.append(runner.forward(seq, [tok], len(prompt_ids) + i, 1)[0])
    return np.stack(rows).astype(np.float64)


def _ids(tiny_model_dir, text):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))(text)["input_ids"]


def _engine(tiny_model_dir, tmp_path):
    from hetero_sd.config import load_config
    from hetero_sd.engine import Engine
    from helpers.serving import write_config

    return Engine.from_config(load_config(write_config(tmp_path / "c.yaml", tiny_model_dir("llama"))))


def _log_softmax(rows):
    x = rows - rows.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_completion_logprobs_equal_with_and_without_speculation_and_the_targets_own(clients, tiny_model_dir,
                                                                                    tmp_path):
    spec, plain = clients
    got = _completion(spec, False)
    assert got == _completion(plain, False)  # text, tokens, values, tops, offsets: all equal
    assert got == _completion(spec, True)  # streamed pieces add up to the whole
    text, tokens, values, tops, offsets = got
    assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    # (the legacy format keys alternatives by text: ids that decode alike share a key)
    assert all(1 <= len(t) <= TOP and max(t.values()) >= v for v, t in zip(values, tops))
    # the same request in-process gives the ids; their logprobs are the target's own log-softmax,
    # computed here one token per call
    engine = _engine(tiny_model_dir, tmp_path)
    prompt_ids = _ids(tiny_model_dir, PROMPT)
    result = engine.generate_ids(prompt_ids, 20, logprobs=TOP, temperature=0)
    assert result.text == text and [e.logprob for e in result.logprobs] == values
    logsm = _log_softmax(_target_rows(tiny_model_dir, prompt_ids, result.token_ids))
    np.testing.assert_allclose(values, [logsm[i, t] for i, t in enumerate(result.token_ids)], atol=1e-6)
    for e, row in zip(result.logprobs, logsm):
        assert [t for t, _ in e.top] == list(np.argsort(-row, kind="stable")[:TOP])


def test_chat_logprobs_equal_with_and_without_speculation(clients):
    spec, plain = clients
    got = _chat(spec, False)
    assert got and got == _chat(plain, False) == _chat(spec, True)
    for token, logprob, top in got:
        assert len(top) == TOP and top[0][1] >= logprob and top == sorted(top, key=lambda x: -x[1])


def test_sampled_logprobs_are_the_warped_distributions(clients, tiny_model_dir, tmp_path, server):
    """Seeded sampling, speculating: each token's logprob is log of the target's warped
    distribution (temperature, top-p) at its position, and the server's equal the engine's."""
    # (a seed whose text repeats itself within 16 tokens, so the n-gram drafter proposes)
    sampling = {"temperature": 0.8, "top_p": 0.9, "seed": 29}
    resp = httpx.post(server.url + "/v1/completions",
                      json={"prompt": PROMPT, "max_tokens": 16, "logprobs": 0, **sampling}).json()
    served = resp["choices"][0]["logprobs"]["token_logprobs"]
    engine = _engine(tiny_model_dir, tmp_path)
    prompt_ids = _ids(tiny_model_dir, PROMPT)
    result = engine.generate_ids(prompt_ids, 16, logprobs=0, **sampling)
    assert result.text == resp["choices"][0]["text"] and [e.logprob for e in result.logprobs] == served
    rows = _target_rows(tiny_model_dir, prompt_ids, result.token_ids)
    probs = warp(rows.astype(np.float32), SamplingParams(**sampling))
    np.testing.assert_allclose(served, [np.log(probs[i, t]) for i, t in enumerate(result.token_ids)], atol=1e-6)
    assert result.stats.drafted > 0  # speculation ran (its rejection sampling decided these tokens)


@pytest.mark.parametrize("path,body,field", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": "3"}, "logprobs"),
])
def test_bad_logprobs_values_are_400s_naming_the_field(server, path, body, field):
    resp = httpx.post(server.url + path, json={"max_tokens": 4, **body})
    assert resp.status_code == 400 and field in resp.json()["error"]["message"]


PENALIZED = {"frequency_penalty": 1.2, "presence_penalty": 0.4, "extra_body": {"repetition_penalty": 1.3},
             "logit_bias": {"7": 3.0}}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_penalties_are_token_identical_with_and_without_speculation(clients, chat):
    spec, plain = clients

    def ask(client, **extra):
        kwargs = dict(model="tiny", max_tokens=20, temperature=0, **extra)
        if chat:
            return client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}],
                                                  **kwargs).choices[0].message.content
        return client.completions.create(prompt=PROMPT, **kwargs).choices[0].text

    penalized = ask(spec, **PENALIZED)
    assert penalized == ask(plain, **PENALIZED)
    assert penalized != ask(spec)  # the penalties change the answer


@pytest.mark.parametrize("body,field", [({"frequency_penalty": 2.5}, "frequency_penalty"),
                                        ({"presence_penalty": -3}, "presence_penalty"),
                                        ({"repetition_penalty": 0}, "repetition_penalty"),
                                        ({"logit_bias": {"5": 500}}, "logit_bias"),
                                        ({"logit_bias": {"x": 1}}, "logit_bias")])
def test_bad_penalties_are_400s_naming_the_field(server, body, field):
    resp = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, **body})
    assert resp.status_code == 400 and field in resp.json()["error"]["message"]


def test_tokenize_and_detokenize(server, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))
    got = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert got["tokens"] == tok(PROMPT)["input_ids"] and got["count"] == len(got["tokens"]) and got["max_model_len"] > 0
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert httpx.post(server.url + "/detokenize", json={"tokens": got["tokens"]}).json()["prompt"] == \
        tok.decode(got["tokens"])
    for path, body in (("/tokenize", {}), ("/detokenize", {"tokens": [10 ** 6]}), ("/detokenize", {"tokens": "x"})):
        resp = httpx.post(server.url + path, json=body)
        assert resp.status_code == 400, (path, body, resp.text)
