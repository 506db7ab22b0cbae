"""The light tokenizer (ir/tokenizer.py) against transformers' own, on the
tokenizers the tests and the default config use: encode, decode and the chat
template give the same ids and text, so an engine may skip importing
transformers; anything else is delegated to transformers' tokenizer."""
from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from hetero_sd.ir import load_model_ir
from hetero_sd.ir.tokenizer import FastTokenizer, as_transformers, load

TEXTS = ["Explain what a heat pump does.", "", " leading and trailing  ", "Grüße 日本語 🙂 naïve",
         "def f(x):\n    return x * 2  # code\n\n\ttabs", "<|im_start|>user\nhi<|im_end|>", "12 345,678.9 €",
         "a" * 300]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 🙂"},
     {"role": "user", "content": "Write a haiku\nabout snow."}],
]


@pytest.fixture(params=["tiny", "smollm2"])
def folder(request, tiny_model_dir, smollm2_gguf):
    if request.param == "tiny":
        return tiny_model_dir("llama")
    tok = load_model_ir(smollm2_gguf).load_tokenizer()  # the default model's cached tokenizer folder
    assert isinstance(tok, FastTokenizer)
    return tok.folder


def test_same_ids_text_and_chat_as_transformers(folder):
    ours, theirs = load(folder), AutoTokenizer.from_pretrained(str(folder))
    assert isinstance(ours, FastTokenizer)
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)
        assert ours(text)["input_ids"] == list(theirs(text)["input_ids"])
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(theirs)) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            want = theirs.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
            assert ours.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False) == want
            ids = theirs.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            assert ours.apply_chat_template(messages, add_generation_prompt=prompt) == list(ids)
    assert (ours.eos_token_id, ours.bos_token_id, len(ours)) == (theirs.eos_token_id, theirs.bos_token_id, len(theirs))
    assert ours.get_vocab() == theirs.get_vocab() and ours.chat_template == theirs.chat_template


def test_other_calls_go_to_transformers(tiny_model_dir):
    ours = load(tiny_model_dir("llama"))
    assert ours.all_special_ids == AutoTokenizer.from_pretrained(str(tiny_model_dir("llama"))).all_special_ids
    assert type(as_transformers(ours)).__module__.startswith("transformers")
    with pytest.raises(AttributeError):
        ours._private_name  # noqa: B018  (private names are never delegated)


def test_configs_it_cannot_reproduce_go_to_transformers(tiny_model_dir, tmp_path):
    import json
    import shutil

    for key, value in (("clean_up_tokenization_spaces", True), ("add_bos_token", True)):
        folder = tmp_path / key
        shutil.copytree(tiny_model_dir("llama"), folder)
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, key: value}))
        assert load(folder) is None
        assert not isinstance(load_model_ir(folder).load_tokenizer(), FastTokenizer)
