"""The llama.cpp peer: the draft-model drafter's cache logic and the acceptance tally
against a fake model (always run), and the peer end to end on a tiny GGUF when
llama-cpp-python is installed (CI does not install it: it compiles for minutes).
Speed is never asserted here."""
from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest

from hetero_sd.bench.__main__ import main
from hetero_sd.bench.llamacpp_peer import GreedyDraftModel, _Counting, context_size
from hetero_sd.bench.common import Workload

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
VOCAB = 11


def successor(token: int) -> int:
    """The fake model's greedy next token: a fixed function of the last token."""
    return (3 * token + 1) % VOCAB


class FakeLlama:
    """What GreedyDraftModel uses of llama_cpp.Llama, with a KV cache of token ids: eval()
    drops the cache from n_tokens on (as Llama.eval does), then appends; logits are those
    of the last evaluated position, and every evaluated position is counted."""

    def __init__(self, n_ctx: int = 64):
        self.input_ids = np.zeros(n_ctx, dtype=np.intc)
        self.n_tokens = 0
        self._n_ctx = n_ctx
        self.evaluated: list[int] = []

    def n_ctx(self) -> int:
        return self._n_ctx

    def reset(self) -> None:
        self.n_tokens = 0

    def eval(self, tokens) -> None:
        assert tokens, "an empty eval leaves no logits to read"
        for t in tokens:
            assert isinstance(t, int)
            self.input_ids[self.n_tokens] = t
            self.n_tokens += 1
            self.evaluated.append(t)

    def logits(self) -> np.ndarray:
        out = np.zeros(VOCAB, dtype=np.float32)
        out[successor(int(self.input_ids[self.n_tokens - 1]))] = 1.0
        return out


def chain(start: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        start = successor(start)
        out.append(start)
    return out


def test_draft_model_drafts_greedily_and_reuses_its_cache():
    fake = FakeLlama()
    draft = GreedyDraftModel(fake, 4, logits=fake.logits)
    prompt = [5, 2, 7]
    first = draft(np.array(prompt, dtype=np.intc))
    assert first.dtype == np.intc and first.tolist() == chain(7, 4)
    # The prompt and three drafts were evaluated; the fourth draft is not until needed.
    assert fake.evaluated == prompt + chain(7, 3) and fake.n_tokens == 6
    # The target accepted two drafts, then corrected the third: only the correction is new.
    fake.evaluated.clear()
    ids = prompt + first.tolist()[:2] + [9]
    second = draft(np.array(ids, dtype=np.intc))
    assert second.tolist() == chain(9, 4)
    assert fake.evaluated == [9] + chain(9, 3)
    assert fake.input_ids[:fake.n_tokens].tolist() == ids + chain(9, 3)
    # Everything accepted plus a bonus token: the unevaluated last draft and the bonus go in.
    fake.evaluated.clear()
    ids = ids + second.tolist() + [successor(second[-1])]
    third = draft(np.array(ids, dtype=np.intc))
    assert fake.evaluated[:2] == [int(second[-1]), ids[-1]] and third.tolist() == chain(ids[-1], 4)


def test_draft_model_reevaluates_a_fully_cached_last_token():
    """A context the draft has wholly evaluated still needs its last position's logits."""
    fake = FakeLlama()
    draft = GreedyDraftModel(fake, 1, logits=fake.logits)  # k=1: nothing beyond the context is evaluated
    draft(np.array([1, 2, 3], dtype=np.intc))
    fake.evaluated.clear()
    assert draft(np.array([1, 2, 3], dtype=np.intc)).tolist() == [successor(3)]
    assert fake.evaluated == [3] and fake.n_tokens == 3


def test_draft_model_after_reset_and_at_the_context_end():
    fake = FakeLlama(n_ctx=8)
    draft = GreedyDraftModel(fake, 4, logits=fake.logits)
    draft(np.array([1, 2, 3], dtype=np.intc))
    draft.reset()  # a new prompt: nothing of the old one may be reused
    fake.evaluated.clear()
    assert draft(np.array([1, 2, 4], dtype=np.intc)).tolist() == chain(4, 4)
    assert fake.evaluated[:3] == [1, 2, 4]
    assert draft(np.arange(6, dtype=np.intc)).tolist() == chain(5, 2)  # 2 positions left of 8
    assert draft(np.arange(8, dtype=np.intc)).tolist() == []


def test_tally_counts_accepted_prefixes_of_each_round():
    counting = _Counting(lambda ids: np.array([7, 8, 9], dtype=np.intc))
    # A call's context holds the last sampled token; its drafts go at positions len(context)...
    counting(np.zeros(4, dtype=np.intc))  # r1: drafts 4..6, all accepted, bonus at 7
    counting(np.zeros(8, dtype=np.intc))  # r2: drafts 8..10, one accepted, a correction at 9
    counting(np.zeros(10, dtype=np.intc))  # r3: drafts 10..12; the output ends after position 10
    full = [0, 0, 0, 0] + [7, 8, 9, 1] + [7, 5] + [7]
    # r1 3/3; r2 1/3 (a mismatch: the whole draft was verified); r3 only position 10 was reached: 1/1.
    assert counting.tally(full) == (3 + 3 + 1, 3 + 1 + 1)
    counting.reset()
    assert counting.calls == [] and counting.tally(full) == (0, 0)


def test_context_fits_the_longest_prompt_and_the_drafts():
    work = Workload([], {"a": [1] * 100, "b": [1] * 30}, [1] * 10, 50, "ignore", ())
    n = context_size(work, 6)
    assert n % 64 == 0 and n >= 100 + 50 + 6 + 1


def test_absent_llama_cpp_is_listed_with_the_pip_command(tiny_gguf, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now fails
    gguf = tiny_gguf("llama", "Q8_0")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "kind": "open", "prompt": "Once upon a time"}) + "\n")
    code = main(["--model", str(gguf), "--config", "none", "--prompts", str(prompts), "--peers", "llamacpp",
                 "--max-new-tokens", "3", "--out", str(tmp_path / "out"), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert report["runs"] == [] and report["results"] == [] and report["meta"]["baseline"] is None
    assert "pip install llama-cpp-python" in report["skipped"]["llamacpp (all runs)"]


needs_llama_cpp = pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed")


@needs_llama_cpp
def test_draft_model_is_a_llama_cpp_draft_model():
    from llama_cpp.llama_speculative import LlamaDraftModel

    from hetero_sd.bench.llamacpp_peer import _import

    _import()
    assert isinstance(GreedyDraftModel(FakeLlama(), 2), LlamaDraftModel)


@needs_llama_cpp
def test_llamacpp_peer_on_a_tiny_gguf(tiny_gguf, tmp_path, capsys):
    """Plain, prompt lookup and the draft model (the same tiny GGUF as draft) on our ids,
    beside our target-only; identity to its own greedy computed for each."""
    gguf = tiny_gguf("llama", "Q8_0")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in [
        {"id": "rep", "kind": "grounded", "prompt": "the quick brown fox jumps over the lazy dog. the quick brown"},
        {"id": "story", "kind": "open", "prompt": "Once upon a time there was a little robot"}]))
    config = tmp_path / "only.yaml"
    config.write_text(f"target: {{model: {gguf}}}\ndrafter: {{kind: none}}\nmemory: {{kv_budget: 1MiB}}\n")
    code = main(["--model", str(gguf), "--draft-model", str(gguf), "--config", str(config),
                 "--prompts", str(prompts), "--peers", "llamacpp", "--max-new-tokens", "12",
                 "--out", str(tmp_path / "out"), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert [r["name"] for r in report["runs"]] == ["ours target-only", "llamacpp plain", "llamacpp prompt-lookup",
                                                   "llamacpp draft-model"], report["skipped"]
    assert report["meta"]["peer_drafting"]["draft_path"] == str(gguf)
    rows = [r for r in report["results"] if r["run"].startswith("llamacpp")]
    assert len(rows) == 3 * 2
    plain = {r["id"]: r["token_ids"] for r in rows if r["run"] == "llamacpp plain"}
    for r in rows:
        assert r["new_tokens"] == len(r["token_ids"]) == 12 and 0 < r["prefill_s"] <= r["total_s"]
        assert r["identical_to_own_greedy"] == (r["token_ids"] == plain[r["id"]])
        assert (r["drafted"] is not None) == (r["run"] != "llamacpp plain")
    # The same weights as draft: every draft the greedy target checks is its own greedy token.
    spec = [r for r in rows if r["run"] == "llamacpp draft-model"]
    assert sum(r["drafted"] for r in spec) > 0
    summary = [s for s in report["summary"] if s["run"] == "llamacpp draft-model" and s["kind"] == "all"]
    assert summary[0]["identical_to_own_greedy"] is not None
    md = (tmp_path / "out" / "bench.md").read_text()
    assert "| all | llamacpp draft-model |" in md and "best llama.cpp" in md


def test_genai_unable_to_read_the_gguf_is_one_skipped_row(tiny_gguf, tmp_path, monkeypatch, capsys):
    """GenAI's GGUF reader takes only some quantizations (not Q4_K_M): the bench says so once."""
    pytest.importorskip("openvino_genai")
    from hetero_sd.bench import genai_peer

    def unreadable(*args, **kwargs):
        raise RuntimeError("Check 'data != nullptr' failed at gguf.cpp:84:\n[load_gguf] gguf_tensor_to_f16 failed")

    monkeypatch.setattr(genai_peer, "_pipeline", unreadable)
    gguf = tiny_gguf("llama", "Q8_0")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "kind": "open", "prompt": "Once upon a time"}) + "\n")
    config = tmp_path / "only.yaml"
    config.write_text(f"target: {{model: {gguf}}}\ndrafter: {{kind: none}}\nmemory: {{kv_budget: 1MiB}}\n")
    code = main(["--model", str(gguf), "--config", str(config), "--prompts", str(prompts), "--peers", "genai",
                 "--max-new-tokens", "3", "--out", str(tmp_path / "out"), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert [r["name"] for r in report["runs"]] == ["ours target-only"]
    (key, why), = report["skipped"].items()
    assert key == "genai (all runs)" and why.startswith(f"GenAI cannot read {gguf.name}: failed: RuntimeError")
    assert "gguf_tensor_to_f16 failed" in why and "\n" not in why
    assert f"- skipped genai (all runs): GenAI cannot read {gguf.name}" in (tmp_path / "out" / "bench.md").read_text()
