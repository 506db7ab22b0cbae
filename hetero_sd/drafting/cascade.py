"""k-stage cascades (PipeSpec-style): each stage verifies the one before it.

    draft -> intermediate -> target  is  Engine(target, CascadeDrafter(draft, intermediate))
    ngram -> int4 -> bf16 -> fp32    is  Engine(fp32, CascadeDrafter(CascadeDrafter(ngram, int4), bf16))

A CascadeDrafter proposes the intermediate model's own greedy continuation of
the context, k tokens of it, and computes them by speculative decoding:
`inner` drafts up to `k_inner` tokens, the intermediate runner scores them in
one call (sampling.accept_greedy, the engine's rule), keeps the agreeing prefix plus
its own next token, and repeats until it has k. Any stage may be a
RemoteDrafter (its own process).

Lossless at every depth: the target verifies whatever the outermost stage
proposes, and proposals never change what the target commits, only how many
tokens a verify keeps. Under sampling the cascade stays lossless: its
proposals are a deterministic function of the context (the inner stages are
run greedily), so its draft distribution is one-hot, which is what
DraftResult.probs = None means to the sampler (the n-gram drafter's case).

Fault tolerance inside the cascade: an inner stage that raises (a dead
worker, a broken device) is dropped for the rest of the request and the
intermediate drafts alone (one token per call); the next request tries the
inner stage again (a RemoteDrafter restarts its worker in begin).

Cache bookkeeping is ModelDrafter's: `_cached` lists the tokens whose KV the
intermediate holds, and each call first truncates it to the longest common
prefix with the context (the target's rejections roll back here too).
"""
from __future__ import annotations

from hetero_sd.backends.base import Runner
from hetero_sd.drafting.base import Drafter, common_prefix
from hetero_sd.drafting.model import check_vocab
from hetero_sd.errors import describe
from hetero_sd.ir.errors import ConfigError
from hetero_sd.ir.work import DraftRequest, DraftResult
from hetero_sd.sampling import accept_greedy


class CascadeDrafter(Drafter):
    """A Drafter whose proposals are `runner`'s greedy tokens, sped up by `inner`."""

    one_hot = True  # its proposals carry no distribution (module docstring)

    def __init__(self, inner: Drafter, runner: Runner, target_vocab: int | None = None, k: int = 4,
                 desc: str = "intermediate", head_vocab: int | None = None):
        vocab = runner.vocab_size if target_vocab is None else target_vocab
        check_vocab(runner, vocab, f"cascade stage {desc}", head_vocab)
        if k < 1:
            raise ConfigError(f"cascade stage {desc}: k (drafts per stage verify) must be >= 1, got {k}")
        self.inner, self.runner, self.k_inner = inner, runner, k
        self.name = f"cascade({inner.name}>{desc})"
        self.events: list[str] = []  # inner-stage failures, across requests
        self.inner_drafted = self.inner_accepted = self.stage_calls = 0
        self._seq: int | None = None
        self._cached: list[int] = []  # tokens whose KV the intermediate's cache holds
        self._inner_ctx: list[int] = []  # the context the inner drafter was last told
        self._inner_live = False

    # ------------------------------------------------------------ the protocol
    def begin(self, capacity: int, sampler=None, guide=None) -> None:
        """`sampler` and `guide` are ignored: the cascade drafts greedily (q one-hot,
        see module docstring), so the engine's cut at the first refused draft is exact."""
        self.reset()
        self._seq = self.runner.allocate(capacity)
        try:
            self.inner.begin(capacity, None)
            self._inner_live = True
        except Exception as exc:
            self._drop_inner(exc)

    def reset(self) -> None:
        if self._seq is not None:
            self.runner.release(self._seq)
        if self._inner_live:
            try:
                self.inner.reset()
            except Exception as exc:
                self.events.append(f"inner {self.inner.name} reset failed: {describe(exc)}")
        self._seq, self._cached, self._inner_ctx = None, [], []
        self._inner_live = False
        self.forget_context()

    def draft(self, req: DraftRequest, rnd=None) -> DraftResult:
        if self._seq is None:
            raise RuntimeError("CascadeDrafter.begin must be called before draft")
        context = self.context_for(req)
        out: list[int] = []
        while len(out) < req.k:  # (each stage round's context is a list of its own: context + out)
            out += self._stage_round(list(context) + out, req.seq_id, req.k - len(out))
        return DraftResult(req.seq_id, out[:req.k])

    def wait_ready(self) -> None:
        self.inner.wait_ready()

    def close(self) -> None:
        self.inner.close()

    # ------------------------------------------------------------ one stage verify
    def _stage_round(self, ctx: list[int], seq_id: int, want: int) -> list[int]:
        """Tokens the intermediate commits after `ctx`: accepted inner drafts plus
        its own next token (1..want of them)."""
        drafts = self._inner_drafts(ctx, seq_id, min(self.k_inner, want - 1))
        common = min(common_prefix(self._cached, ctx), len(ctx) - 1)  # feed >= 1 token to get logits
        self.runner.truncate(self._seq, common)
        del self._cached[common:]
        feed = ctx[common:]
        ids = self.runner.greedy(self._seq, feed + drafts, common, len(drafts) + 1)
        self.stage_calls += 1
        accepted, tokens = accept_greedy(drafts, ids)
        kept = len(ctx) + accepted  # the bonus token was never fed
        self.runner.truncate(self._seq, kept)
        self._cached = (self._cached + feed + drafts)[:kept]
        self.inner_drafted += len(drafts)
        self.inner_accepted += accepted
        return tokens

    def _inner_drafts(self, ctx: list[int], seq_id: int, k: int) -> list[int]:
        if not self._inner_live or k <= 0:
            return []
        base = common_prefix(self._inner_ctx, ctx)
        try:
            proposal = self.inner.draft(DraftRequest(seq_id, base, k, ctx[base:], context=ctx))
            drafts = list(proposal.tokens[:k])
            bad = [t for t in drafts if not 0 <= t < self.runner.vocab_size]
            if bad:
                raise ValueError(f"inner stage proposed token ids outside the vocabulary: {bad}")
        except Exception as exc:
            self._drop_inner(exc)
            return []
        self._inner_ctx = ctx  # (never changed after: the next round makes its own)
        return drafts

    def _drop_inner(self, exc: BaseException) -> None:
        self._inner_live = False
        self.events.append(f"inner {self.inner.name} failed: {describe(exc)}; "
                           "the stage drafts alone for this request")
        try:
            self.inner.reset()
        except Exception:
            pass
