"""n > 1 through the real `openai` client: each choice its own sequence in the
batch; seeded choices reproduce (choice i samples with seed + i, so it equals a
one-choice request with that seed), differ from each other, and stream as
they are whole; greedy choices are all the greedy answer."""
from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "the cat sat on the mat. " * 6
SAMPLED = {"temperature": 1.0, "seed": 11}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=60)


def _texts(client, n, stream=False, chat=False, **sampling):
    kwargs = dict(model="tiny", max_tokens=16, n=n, stream=stream, **sampling)
    if chat:
        resp = client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], **kwargs)
    else:
        resp = client.completions.create(prompt=PROMPT, **kwargs)
    if not stream:
        assert [c.index for c in resp.choices] == list(range(n))
        return [c.message.content if chat else c.text for c in resp.choices], resp.usage
    texts, finished = [""] * n, set()
    for chunk in resp:
        for c in chunk.choices:
            texts[c.index] += (c.delta.content if chat else c.text) or ""
            if c.finish_reason is not None:
                finished.add(c.index)
    assert finished == set(range(n))
    return texts, None


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_seeded_choices_reproduce_differ_and_stream_alike(client, chat):
    first, usage = _texts(client, 3, chat=chat, **SAMPLED)
    again, _ = _texts(client, 3, chat=chat, **SAMPLED)
    streamed, _ = _texts(client, 3, stream=True, chat=chat, **SAMPLED)
    assert first == again == streamed
    assert len(set(first)) == 3  # three draws at temperature 1 over a 384-token vocabulary
    for i in range(3):  # choice i is the seed + i draw
        assert _texts(client, 1, chat=chat, temperature=1.0, seed=11 + i)[0] == [first[i]]
    assert usage.completion_tokens >= 3  # summed over the choices


def test_greedy_choices_are_the_greedy_answer(client):
    texts, _ = _texts(client, 2, temperature=0)
    assert texts == _texts(client, 1, temperature=0)[0] * 2
