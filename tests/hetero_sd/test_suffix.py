"""SuffixDrafter (suffix decoding): the trees against a brute-force reference,
the drafting rules, rollback, the global tree's bounds and sharing, and the
engine: greedy output equals target-only, and earlier requests' outputs raise
acceptance on later ones."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero_sd.config import load_config
from hetero_sd.drafting.build import build_drafter
from hetero_sd.drafting.specs import SuffixSpec, WorkerSpec, has_distributions
from hetero_sd.drafting.suffix import GlobalTree, RequestTree, SuffixDrafter
from hetero_sd.errors import ConfigError
from hetero_sd.ir.work import MAX_DRAFT_TOKENS, DraftRequest
from hetero_sd.spec import spec_from_config


# ------------------------------------------------------------------ brute-force reference
def ref_counts(seqs: list[list[int]], depth: int) -> dict[tuple, int]:
    """How often every string of up to `depth` tokens occurs in `seqs`."""
    counts: dict[tuple, int] = {}
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, min(depth, len(s) - i) + 1):
                counts[tuple(s[i:i + n])] = counts.get(tuple(s[i:i + n]), 0) + 1
    return counts


def ref_walk(seqs: list[tuple[int, list[int]]], suffix: list[int], limit: int, min_prob: float,
             depth: int) -> list[int]:
    """Follow the most frequent next token (ties: the occurrence ending latest, by
    (sequence number, position)) while the product of the frequency ratios stays >= min_prob."""
    path, out, prob = list(suffix), [], 1.0
    while len(out) < limit and len(path) < depth:
        nexts: dict[int, tuple[int, tuple]] = {}
        for number, s in seqs:
            n = len(path)
            for j in range(len(s) - n):
                if s[j:j + n] == path:
                    token, when = s[j + n], (number, j + n)
                    count, latest = nexts.get(token, (0, when))
                    nexts[token] = (count + 1, max(latest, when))
        if not nexts:
            break
        total = sum(count for count, _ in nexts.values())
        token, (count, _) = max(nexts.items(), key=lambda item: item[1])
        prob *= count / total
        if prob < min_prob:
            break
        out.append(token)
        path.append(token)
    return out


def ref_draft(ctx: list[int], earlier: list[list[int]], k: int, max_depth: int = 24, factor: float = 1.0,
              min_prob: float = 0.1) -> tuple[list[int], int]:
    """(draft, match length): the longest suffix (<= max_depth) seen before with a
    continuation, in the context itself (preferred on a tie) or in `earlier`."""
    depth, n = max_depth + MAX_DRAFT_TOKENS, len(ctx)
    local = next((m for m in range(min(max_depth, n - 1), 0, -1)
                  if any(ctx[j:j + m] == ctx[n - m:] for j in range(n - m))), 0)
    glob = next((m for m in range(min(max_depth, n), 0, -1)
                 if any(s[j:j + m] == ctx[n - m:] for s in earlier for j in range(len(s) - m))), 0)
    mine, theirs = ([(0, ctx)], local), ([(i + 1, s) for i, s in enumerate(earlier)], glob)
    options = [mine, theirs] if local >= glob else [theirs, mine]
    for seqs, m in options:
        limit = min(k, int(factor * m + 1e-9))
        if m and limit > 0:
            out = ref_walk(seqs, ctx[n - m:], limit, min_prob, depth)
            if out:
                return out, m
    return [], 0


def propose(context: list[int], k: int, **kwargs) -> list[int]:
    return SuffixDrafter(**kwargs).draft(DraftRequest(0, 0, k, list(context))).tokens


def finish(drafter: SuffixDrafter, prompt: list[int], output: list[int]) -> None:
    """A request as the engine makes it: prompt + first token, then the rest, then reset."""
    drafter.begin(len(prompt) + len(output))
    drafter.draft(DraftRequest(0, 0, 4, prompt + output[:1]))
    drafter.draft(DraftRequest(0, len(prompt) + 1, 4, output[1:]))
    drafter.reset()


# ------------------------------------------------------------------ drafting rules on fixed contexts
def test_proposes_the_continuation_of_an_earlier_occurrence():
    # The suffix (5, 6) matched 2 tokens: with factor 1 the draft is at most 2 long.
    assert propose([5, 6, 7, 8, 9, 5, 6], k=8) == [7, 8]
    assert propose([5, 6, 7, 8, 9, 5, 6], k=8, factor=2.0) == [7, 8, 9, 5]
    assert propose([5, 6, 7, 8, 9, 5, 6], k=1, factor=2.0) == [7]


def test_draft_length_follows_the_match_length():
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    drafter = SuffixDrafter()
    assert drafter.draft(DraftRequest(0, 0, 16, text + text[:3])).tokens == text[3:6]
    assert drafter.match_len == 3 and drafter.source == "local"
    assert drafter.draft(DraftRequest(0, 15, 16, text[3:7])).tokens == text[7:12] + text[:2]
    assert drafter.match_len == 7
    assert drafter.draft(DraftRequest(0, 19, 4, [])).tokens == text[7:11]  # k still bounds it


def test_the_most_frequent_continuation_wins():
    # (1, 2) was followed by 3 twice, by 4 once (most recently): 3 wins, unlike prompt lookup.
    context = [1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 4, 7, 1, 2]
    assert propose(context, k=1) == [3]


def test_a_tie_goes_to_the_most_recent_continuation():
    assert propose([1, 2, 3, 5, 1, 2, 4, 6, 1, 2], k=1) == [4]
    assert propose([1, 2, 4, 5, 1, 2, 3, 6, 1, 2], k=1) == [3]


def test_low_probability_continuations_are_not_drafted():
    context = [1, 2, 3, 5, 1, 2, 4, 6, 1, 2]  # 3 and 4 after (1, 2): each has probability 1/2
    assert propose(context, k=2, min_token_prob=0.5) == [4, 6]
    assert propose(context, k=2, min_token_prob=0.6) == []
    # The product of the ratios is what is bounded. After (1, 2): 3 twice, 6 twice (6 latest);
    # after (1, 2, 6): 8 once, 9 once (9 latest): 6 has 1/2, then 9 has 1/2 * 1/2.
    context = [1, 2, 3, 4, 10, 1, 2, 3, 5, 11, 1, 2, 6, 8, 12, 1, 2, 6, 9, 13, 1, 2]
    drafter = SuffixDrafter(min_token_prob=0.3, factor=4.0)
    assert drafter.draft(DraftRequest(0, 0, 2, context)).tokens == [6]
    assert drafter.score == pytest.approx(0.5)
    drafter = SuffixDrafter(min_token_prob=0.2, factor=4.0)
    assert drafter.draft(DraftRequest(0, 0, 2, context)).tokens == [6, 9]
    assert drafter.score == pytest.approx(0.75)


def test_the_longest_match_is_used():
    # (2, 3) alone was last followed by 20; (1, 2, 3) by 10.
    context = [1, 2, 3, 10, 0, 2, 3, 20, 5, 1, 2, 3]
    drafter = SuffixDrafter()
    assert drafter.draft(DraftRequest(0, 0, 1, context)).tokens == [10]
    assert drafter.match_len == 3
    assert propose(context, k=1, max_depth=2) == [20]


def test_nothing_to_draft():
    assert propose([], k=4) == []
    assert propose([1, 2, 3, 4], k=4) == []
    drafter = SuffixDrafter()
    assert drafter.draft(DraftRequest(0, 0, 4, [9, 1, 2])).tokens == []
    assert (drafter.match_len, drafter.score, drafter.source) == (0, 0.0, None)


def test_result_carries_the_sequence_id_and_no_distributions():
    result = SuffixDrafter().draft(DraftRequest(42, 0, 2, [1, 2, 3, 1, 2]))
    assert result.seq_id == 42 and result.tokens == [3, 1] and result.probs is None


def test_a_grammar_cuts_the_draft_where_it_refuses():
    class Guide:
        def valid_prefix(self, tokens):
            return tokens.index(9) if 9 in tokens else len(tokens)

    drafter = SuffixDrafter(factor=4.0)
    drafter.begin(64, guide=Guide())
    assert drafter.draft(DraftRequest(0, 0, 4, [1, 2, 3, 9, 4, 1, 2])).tokens == [3]


def test_bad_parameters_are_config_errors():
    for kwargs, message in [({"max_depth": 0}, "max_depth"), ({"factor": 0}, "factor"),
                            ({"min_token_prob": 1.5}, "min_token_prob"), ({"max_cached_requests": -1}, "cache")]:
        with pytest.raises(ConfigError, match=message):
            SuffixDrafter(**kwargs)


def test_base_len_beyond_the_known_context_is_refused():
    drafter = SuffixDrafter()
    drafter.draft(DraftRequest(0, 0, 3, [1, 2, 3]))
    with pytest.raises(ValueError, match=r"base_len 5 beyond known 3 tokens"):
        drafter.draft(DraftRequest(0, 5, 3, [4]))


# ------------------------------------------------------------------ rollback
def test_rollback_forgets_tokens_past_base_len():
    drafter = SuffixDrafter(factor=4.0)
    assert drafter.draft(DraftRequest(0, 0, 4, [5, 1, 2, 8, 5, 1, 2])).tokens == [8, 5, 1, 2]
    # Back to one token, then others: (5, 1, 2) -> 8 is forgotten.
    assert drafter.draft(DraftRequest(0, 1, 4, [3, 3, 1, 2])).tokens == []
    assert drafter.context == [5, 3, 3, 1, 2]
    assert drafter.tree.counts() == ref_counts([[5, 3, 3, 1, 2]], drafter.depth)
    assert drafter.draft(DraftRequest(0, 5, 4, [3, 3])).tokens == propose([5, 3, 3, 1, 2, 3, 3], 4, factor=4.0)


def test_rollback_restores_recency():
    # (1, 2) is followed by 3, 5, 6, then 3 again: rolled back, the tie among 3, 5 and 6
    # goes to 6, the latest left (3's recency is its first occurrence again).
    context = [1, 2, 3, 10, 1, 2, 5, 11, 1, 2, 6, 12, 1, 2, 3]
    drafter = SuffixDrafter()
    drafter.draft(DraftRequest(0, 0, 1, context))
    assert drafter.draft(DraftRequest(0, 14, 1, [])).tokens == [6] == propose(context[:14], 1)


def test_resent_tokens_are_not_rolled_back():
    drafter = SuffixDrafter()
    drafter.draft(DraftRequest(0, 0, 4, [1, 2, 3, 1, 2]))
    nodes = drafter.tree.root.children[1]
    drafter.draft(DraftRequest(0, 0, 4, [1, 2, 3, 1, 2, 3]))
    assert drafter.tree.root.children[1] is nodes and drafter.context == [1, 2, 3, 1, 2, 3]


def test_request_tree_depth_limit():
    tree = RequestTree(3)
    for token in [1, 2, 3, 4, 1, 2, 3, 4]:
        tree.append(token)
    assert tree.counts() == ref_counts([[1, 2, 3, 4, 1, 2, 3, 4]], 3)
    assert max(map(len, tree.counts())) == 3


# ------------------------------------------------------------------ the global tree
def test_an_earlier_output_is_drafted_from():
    drafter = SuffixDrafter()
    prompt, output = [50, 51, 52, 53], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69]
    finish(drafter, prompt, output)
    assert drafter.global_tree.counts() == ref_counts([prompt + output], drafter.depth)
    # The same prompt again: its last tokens lead into the earlier output at once.
    drafter.begin(64)
    assert drafter.draft(DraftRequest(0, 0, 8, prompt + output[:1])).tokens == output[1:6]
    assert drafter.source == "global" and drafter.match_len == 5
    drafter.reset()
    # Another prompt: a piece of the earlier output, then its continuation.
    drafter.begin(64)
    assert drafter.draft(DraftRequest(0, 0, 3, [7, 7, 62, 63])).tokens == [64, 65]


def test_only_the_prompt_tail_joins_the_global_tree():
    drafter = SuffixDrafter(max_depth=2)
    finish(drafter, [1, 2, 3, 4, 5], [6, 7, 8])
    assert drafter.global_tree.counts() == ref_counts([[4, 5, 6, 7, 8]], drafter.depth)
    drafter.begin(8)
    drafter.reset()  # a request that drafted nothing adds nothing
    assert len(drafter.global_tree.order) == 1


def test_the_per_request_tree_wins_a_tie():
    for context, want, source in [([1, 2, 3, 1, 2], [3], "local"),  # both match (1, 2)
                                  ([8, 1, 2, 3, 4, 1, 2], [9], "global")]:  # (4, 1, 2) only before
        drafter = SuffixDrafter()
        drafter.add_to_global([4, 1, 2, 9])
        assert drafter.draft(DraftRequest(0, 0, 1, context)).tokens == want
        assert drafter.source == source


def test_the_global_tree_is_bounded_fifo():
    drafter = SuffixDrafter(max_cached_requests=2)
    outputs = [[10 + i, 20 + i, 30 + i, 40 + i] for i in range(3)]
    for i, output in enumerate(outputs):
        finish(drafter, [i], output)
    assert len(drafter.global_tree.order) == 2
    assert drafter.global_tree.counts() == ref_counts([[1] + outputs[1], [2] + outputs[2]], drafter.depth)
    assert propose_after(drafter, [10, 20]) == []  # the oldest is gone
    assert propose_after(drafter, [11, 21]) == [31, 41]
    tokens = SuffixDrafter(max_cached_tokens=9)
    for i, output in enumerate(outputs):
        finish(tokens, [i], output)
    assert tokens.global_tree.tokens == 5 and len(tokens.global_tree.order) == 1


def propose_after(drafter: SuffixDrafter, context: list[int], k: int = 4) -> list[int]:
    drafter.begin(64)
    out = drafter.draft(DraftRequest(0, 0, k, context)).tokens
    drafter._fresh()  # (a probe, not a request: nothing joins the global tree)
    return out


def test_eviction_frees_the_tree():
    drafter = SuffixDrafter(max_cached_requests=3)
    for i in range(40):
        finish(drafter, [i % 5, 1, 2], [3, 4, i % 7, 5, 6, i % 3, 7, 8])
    tree = drafter.global_tree
    kept = [tree.seqs[sid] for sid in tree.order]
    assert len(kept) == 3 and tree.tokens == sum(map(len, kept))
    assert tree.counts() == ref_counts(kept, drafter.depth)
    assert tree.nodes() <= 2 * tree.tokens + 1
    drafter.clear_global()
    assert tree.nodes() == 1 and tree.tokens == 0


def test_forks_share_the_global_tree_and_keep_their_own_context():
    parent = SuffixDrafter()
    fork = parent.fork()
    assert fork.global_tree is parent.global_tree and fork.tree is not parent.tree
    parent.begin(64)
    fork.begin(64)
    parent.draft(DraftRequest(0, 0, 4, [1, 2, 3, 4, 5]))
    assert fork.draft(DraftRequest(1, 0, 4, [9, 1, 2])).tokens == []  # the parent's context is not the fork's
    assert fork.context == [9, 1, 2] and parent.context == [1, 2, 3, 4, 5]
    parent.draft(DraftRequest(0, 5, 4, [6, 7, 8]))
    parent.reset()  # the parent's output joins the shared tree: the fork, mid-request, sees it
    assert fork.draft(DraftRequest(1, 3, 4, [3])).tokens == [4, 5, 6]
    assert fork.source == "global"
    fork.reset()
    assert len(parent.global_tree.order) == 2


def test_clear_global_forgets_earlier_requests():
    drafter = SuffixDrafter()
    finish(drafter, [1], [2, 3, 4, 5, 6])
    fork = drafter.fork()
    assert propose_after(fork, [9, 3, 4]) == [5, 6]
    drafter.clear_global()
    assert propose_after(fork, [9, 3, 4]) == [] and propose_after(drafter, [9, 3, 4]) == []


def test_global_tree_splits_and_merges_edges():
    tree = GlobalTree(6)
    tree.add([1, 2, 3, 4, 5])
    tree.add([1, 2, 3, 9])
    tree.add([2, 3, 4, 5, 6])
    assert tree.counts() == ref_counts([[1, 2, 3, 4, 5], [1, 2, 3, 9], [2, 3, 4, 5, 6]], 6)
    tree.evict_oldest()
    assert tree.counts() == ref_counts([[1, 2, 3, 9], [2, 3, 4, 5, 6]], 6)
    edge = tree.root.children[2]  # (2, 3) then 4 5 6 or 9: one edge down to the branch
    assert (edge.top, edge.depth, edge.count) == (1, 2, 2)
    # An edge split for an occurrence that is evicted becomes one edge again.
    tree = GlobalTree(6)
    tree.add([1, 2, 3, 4])
    tree.add([1, 2, 5])
    assert tree.root.children[1].depth == 2
    tree.evict_oldest()
    assert tree.root.children[1].depth == 3 and tree.nodes() == 4  # the root, (1 2 5), (2 5), (5)


# ------------------------------------------------------------------ incremental == reference
ALPHABET = st.integers(min_value=0, max_value=3)  # small: many repeats, ties and branches


@st.composite
def streams(draw):
    """Drafter parameters, earlier outputs, and delta steps (rollback, new tokens, k)."""
    params = {"max_depth": draw(st.integers(1, 6)), "factor": draw(st.sampled_from([0.5, 1.0, 3.0])),
              "min_token_prob": draw(st.sampled_from([0.0, 0.1, 0.4]))}
    earlier = draw(st.lists(st.lists(ALPHABET, min_size=1, max_size=25), max_size=3))
    steps = draw(st.lists(st.tuples(st.integers(0, 6), st.lists(ALPHABET, max_size=8), st.integers(1, 16)),
                          min_size=1, max_size=10))
    return params, earlier, steps


@settings(max_examples=400, deadline=None)
@given(streams())
def test_incremental_drafts_match_the_reference(stream):
    """Delta requests, sometimes rolled back, with earlier outputs in the global
    tree: every draft is the reference's, and the trees hold exactly the counts."""
    params, earlier, steps = stream
    drafter = SuffixDrafter(**params)
    for output in earlier:
        drafter.add_to_global(output)
    assert drafter.global_tree.counts() == ref_counts(earlier, drafter.depth)
    context: list[int] = []
    for rollback, new_tokens, k in steps:
        base_len = max(0, len(context) - rollback)
        context = context[:base_len] + new_tokens
        got = drafter.draft(DraftRequest(7, base_len, k, list(new_tokens)))
        want, match = ref_draft(context, earlier, k, params["max_depth"], params["factor"],
                                params["min_token_prob"])
        assert drafter.context == context
        assert got.tokens == want
        assert drafter.match_len == match
        assert drafter.tree.counts() == ref_counts([context], drafter.depth)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.lists(ALPHABET, min_size=1, max_size=12), st.lists(ALPHABET, min_size=1, max_size=20)),
                min_size=1, max_size=8), st.integers(1, 4), st.integers(1, 5))
def test_requests_in_turn_match_the_reference(requests, cap, max_depth):
    """Whole requests through begin/draft/reset: the global tree holds the last
    `cap` outputs (each after its prompt's last max_depth tokens), evicted FIFO."""
    drafter, earlier = SuffixDrafter(max_depth=max_depth, max_cached_requests=cap), []
    for prompt, output in requests:
        drafter.begin(64)
        context, synced = prompt + output[:1], 0
        for i in range(1, len(output) + 1):
            got = drafter.draft(DraftRequest(0, synced, 5, context[synced:])).tokens
            assert got == ref_draft(context, earlier, 5, max_depth)[0]
            synced, context = len(context), context + output[i:i + 1]
        drafter.reset()
        earlier = (earlier + [prompt[max(0, len(prompt) - max_depth):] + output])[-cap:]
        assert drafter.global_tree.counts() == ref_counts(earlier, drafter.depth)


# ------------------------------------------------------------------ configuration
def _yaml(tmp_path, drafter: str, model=None) -> Path:
    path = tmp_path / "suffix.yaml"
    path.write_text(f"target: {{model: {model or tmp_path}, precision: fp32}}\ndrafter: {drafter}\n"
                    "memory: {kv_budget: 4MiB}\ngeneration: {max_new_tokens: 16, chat_template: false}\n")
    return path


def test_yaml_suffix_drafter_becomes_its_spec_and_drafter(tmp_path):
    cfg = load_config(_yaml(tmp_path, "{kind: suffix, k: 6, suffix_max_depth: 32, suffix_factor: 1.5, "
                                      "suffix_min_prob: 0.2, suffix_cache_requests: 9}"))
    spec = spec_from_config(cfg).drafter
    assert spec == SuffixSpec(32, 1.5, 0.2, 9) and spec.label == "suffix"
    drafter = build_drafter(spec, target_vocab=100)
    assert isinstance(drafter, SuffixDrafter)
    assert (drafter.max_depth, drafter.factor, drafter.min_token_prob, drafter.max_cached_requests) == (32, 1.5, 0.2, 9)
    assert spec_from_config(load_config(_yaml(tmp_path, "{kind: suffix}"))).drafter == SuffixSpec()
    worker = spec_from_config(load_config(_yaml(tmp_path, "{kind: suffix, process: worker, transport: pipe}")))
    assert worker.drafter == WorkerSpec(SuffixSpec(), "pipe") and not has_distributions(worker.drafter)


@pytest.mark.parametrize("drafter, words", [
    ("{kind: suffix, suffix_factr: 2}", ["suffix.yaml", "drafter.suffix_factr", "unknown key", "suffix_factor"]),
    ("{kind: suffix, suffix_min_prob: 2}", ["suffix.yaml", "drafter.suffix_min_prob", "less than or equal to 1"]),
    ("{kind: suffix, suffix_max_depth: 0}", ["drafter.suffix_max_depth", "greater than or equal to 1"]),
    ("{kind: suffix, suffix_factor: 0}", ["drafter.suffix_factor", "greater than 0"]),
    ("{kind: ngram, suffix_factor: 2}", ["suffix.yaml", "drafter.suffix_factor", "drafter.kind: suffix", "'ngram'"]),
    ("{kind: sufix}", ["drafter.kind", "'suffix'"]),
])
def test_yaml_suffix_errors_name_the_key_and_file(tmp_path, drafter, words):
    with pytest.raises(ConfigError) as err:
        load_config(_yaml(tmp_path, drafter))
    for word in words:
        assert word in str(err.value)


# ------------------------------------------------------------------ the engine
def _torch_target(folder):
    from hetero_sd.backends.torch_backend import TorchBackend
    from hetero_sd.ir import load_model_ir

    return TorchBackend().load(load_model_ir(folder), "cpu", "fp32", 4 << 20)


def _prompts(count: int, seed: int) -> list[list[int]]:
    """Random prompts of several lengths, every other one with a repeated stretch."""
    from helpers.tiny_models import random_prompt

    out = []
    for i in range(count):
        head = random_prompt(4 + 5 * i, seed=seed + i)
        out.append(head + head if i % 2 else head)
    return out


@pytest.mark.parametrize("variant, ks", [("llama", range(1, 9)), ("qwen2", (2, 5, 8))])
def test_greedy_output_equals_target_only(tiny_model_dir, variant, ks):
    """k = 1..8, prompts of several lengths and seeds, one engine per k: each
    drafts three requests, the third a repeat of the first, so the global tree
    (earlier outputs) drafts as well as the request's own."""
    from hetero_sd.engine import Engine

    target = _torch_target(tiny_model_dir(variant))
    prompts = _prompts(4, seed=11)
    new = [16, 20, 18, 22]
    want = [Engine(target, None).generate_ids(p, n, target_only=True) for p, n in zip(prompts, new)]
    drafted = accepted = 0
    for k in ks:
        drafter = SuffixDrafter()
        engine = Engine(target, drafter, k=k, eos_ids=())
        for i in (k % 4, (k + 1) % 4, k % 4):
            got = engine.generate_ids(prompts[i], new[i])
            assert got.token_ids == want[i].token_ids, f"{variant} k={k} prompt {i}: diverged"
            assert got.stats.finish_reason == want[i].stats.finish_reason and got.stats.lossless == "exact"
            drafted, accepted = drafted + got.stats.drafted, accepted + got.stats.accepted
        assert len(drafter.global_tree.order) == 3
    assert 0 < accepted < drafted  # both accepted and rejected drafts were exercised


def _pass(engine, prompts, new=20) -> list[tuple]:
    out = []
    for prompt in prompts:
        res = engine.generate_ids(prompt, new)
        out.append((tuple(res.token_ids), res.stats.drafted, res.stats.accepted, res.stats.rounds))
    return out


def test_earlier_outputs_raise_acceptance_and_clear_global_forgets_them(tiny_model_dir):
    from hetero_sd.engine import Engine

    target = _torch_target(tiny_model_dir("llama"))
    drafter = SuffixDrafter()
    engine = Engine(target, drafter, k=4, eos_ids=())
    prompts = _prompts(4, seed=3)
    first = _pass(engine, prompts)
    second = _pass(engine, prompts)
    for prompt, (ids1, drafted1, accepted1, _), (ids2, drafted2, accepted2, _) in zip(prompts, first, second):
        assert ids1 == ids2 == tuple(engine.generate_ids(prompt, 20, target_only=True).token_ids)
        assert accepted2 >= accepted1 and accepted2 / drafted2 >= accepted1 / max(drafted1, 1)
    # The same prompt again: its output is in the global tree, found from the prompt's tail.
    assert all(a2 > a1 for (_, _, a1, _), (_, _, a2, _) in zip(first, second))
    drafter.clear_global()
    assert _pass(engine, prompts) == first  # deterministic: what pass 1 saw, pass 3 sees


def test_yaml_suffix_drafter_in_a_worker_keeps_its_global_tree(tiny_model_dir, tmp_path, one_torch_thread):
    from hetero_sd.drafting.remote import RemoteDrafter
    from hetero_sd.engine import build_engine

    cfg = load_config(_yaml(tmp_path, "{kind: suffix, k: 4, process: worker, transport: pipe, mode: async, "
                                      "threads: 1}", model=tiny_model_dir("llama")))
    engine = build_engine(cfg)
    try:
        assert isinstance(engine.drafter, RemoteDrafter)
        prompt = _prompts(2, seed=5)[1]
        want = engine.generate_ids(prompt, 24, target_only=True).token_ids
        runs = [engine.generate_ids(prompt, 24) for _ in range(2)]
        assert [r.token_ids for r in runs] == [want, want]
        assert runs[0].stats.mode == "suffix@pipe-async" and runs[0].stats.events == []
        assert runs[1].stats.accepted > runs[0].stats.accepted  # the worker's global tree saw run 0
        assert engine.drafter.stats.starts == 1
    finally:
        engine.close()


def test_yaml_suffix_drafter_in_process_persists_across_requests(tiny_model_dir, tmp_path):
    from hetero_sd.engine import build_engine

    engine = build_engine(load_config(_yaml(tmp_path, "{kind: suffix, k: 4, suffix_cache_requests: 1}",
                                            model=tiny_model_dir("llama"))))
    drafter = engine.drafter
    assert isinstance(drafter, SuffixDrafter)
    for prompt in _prompts(3, seed=8):
        engine.generate_ids(prompt, 12)
    assert engine.drafter is drafter and len(drafter.global_tree.order) == 1


def test_a_seeded_sampled_request_does_not_depend_on_earlier_ones():
    """Its drafts decide how its random draws are used: from its own tree alone,
    the same seed gives the same tokens whatever ran before; drafting from the
    global tree too (global_for_seeded) it may not."""
    from hetero_sd.engine import Engine
    from hetero_sd.sampling import SamplingParams
    from helpers.table_model import TableRunner

    prompt, seeded = [0, 1, 2, 0, 1], SamplingParams(1.0, seed=5)
    outputs = {}
    for global_for_seeded in (False, True):
        engine = Engine(TableRunner(4, seed=0), SuffixDrafter(global_for_seeded=global_for_seeded), k=3)
        runs = []
        for other_seed in range(12):
            runs.append(engine.generate_ids(prompt, 24, sampling=seeded).token_ids)
            engine.generate_ids(prompt, 24, sampling=SamplingParams(1.0, seed=100 + other_seed))
        outputs[global_for_seeded] = runs
    assert all(run == outputs[False][0] for run in outputs[False])
    assert any(run != outputs[True][0] for run in outputs[True])  # the test can tell


def test_batched_requests_fork_the_drafter_and_share_its_global_tree(tiny_model_dir):
    """The batching server forks the drafter per request: every output equals
    target-only, the forks' outputs join the one global tree, and a prompt that
    arrives after its twin finished drafts from the twin's output."""
    import threading

    from hetero_sd.backends.registry import discover
    from hetero_sd.engine import Engine
    from hetero_sd.ir import load_model_ir
    from hetero_sd.serve.batch import BatchEngine, Request
    from helpers.tiny_models import make_tokenizer

    target = discover().get("onnxruntime").load(load_model_ir(tiny_model_dir("llama")), "cpu", "fp32", 8 << 20)
    drafter = SuffixDrafter()
    engine = Engine(target, drafter, k=4, tokenizer=make_tokenizer())
    prompts = _prompts(4, seed=21)

    def serve(requests):
        batch, done = BatchEngine(engine, max_running=8, max_waiting=16).start(), []
        try:
            for req in requests:
                finished, events = threading.Event(), []
                batch.submit(req, lambda e, f=finished, ev=events: (ev.append(e), e.finish_reason and f.set()))
                done.append((finished, events))
            for finished, _ in done:
                assert finished.wait(120)
        finally:
            batch.shutdown(drain_s=60)
        return [events[-1].result for _, events in done]

    first = serve([Request(p, 20) for p in prompts])
    assert len(drafter.global_tree.order) == 4  # every fork's output joined the shared tree
    again = serve([Request(p, 20) for p in prompts])
    for prompt, a, b in zip(prompts, first, again):
        want = engine.generate_ids(prompt, 20, target_only=True).token_ids
        assert a.token_ids == b.token_ids == want
    assert sum(r.stats.accepted for r in again) > sum(r.stats.accepted for r in first)
