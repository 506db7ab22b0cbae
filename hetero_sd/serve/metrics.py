"""Prometheus metrics, named as vLLM names them so its dashboards work.

Every series is vLLM's with `hetero_sd:` in place of `vllm:` (prometheus_client
adds `_total` to a counter's name on exposition, so a Counter named
`hetero_sd:prompt_tokens` is scraped as `hetero_sd:prompt_tokens_total`, as
`vllm:prompt_tokens_total` is). Each carries the placement labels `model_name`,
`target` (backend:device:precision) and `drafter` (its name, or "none").

Counters and histograms are fed from BatchEngine's on_finish hook, once per
request, from the request's own GenerationStats, so the spec-decode counters
equal the sum of the `speculation` fields the responses carried. Gauges are
read from the batch engine at scrape time (a custom collector), so they are
never stale.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from hetero_sd.serve.protocol import FINISH

PREFIX = "hetero_sd:"
LABELS = ("model_name", "target", "drafter")
# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def placement(engine) -> dict[str, str]:
    """The label values for an engine: where the target runs and which drafter drafts."""
    target = engine.target
    drafter = engine.drafter
    return {"target": f"{target.device.backend}:{target.device.device}:{target.precision.name}",
            "drafter": drafter.name if drafter is not None else "none"}


class Metrics:
    def __init__(self, model_name: str, target: str, drafter: str):
        self.registry = CollectorRegistry()
        self.values = (model_name, target, drafter)
        self.batch = None  # the BatchEngine the gauges read (watch)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()):
            return Counter(PREFIX + name, doc, LABELS + extra, registry=self.registry)

        def histogram(name: str, doc: str, buckets):
            return Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=self.registry).labels(*self.values)

        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.").labels(*self.values)
        self.generation_tokens = counter("generation_tokens", "Generation tokens produced.").labels(*self.values)
        self.success = counter("request_success", "Requests finished, by finish reason.", ("finished_reason",))
        self.drafts = counter("spec_decode_num_drafts", "Rounds that drafted at least one token.").labels(*self.values)
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.").labels(*self.values)
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                       "Draft tokens accepted.").labels(*self.values)
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (0-based).", ("position",))
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token (from arrival).", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time per output token after the first.",
                              TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to last token.", E2E_BUCKETS)
        # per batched target call (vLLM's iteration_tokens_total), and how many sequences shared it
        self.step_tokens = histogram("iteration_tokens_total", "Rows scored per target call (committed + drafts).",
                                     STEP_BUCKETS)
        self.step_sequences = histogram("iteration_sequences", "Sequences verified together per target call.",
                                        STEP_BUCKETS)
        self.registry.register(_Gauges(self))

    def watch(self, batch) -> None:
        self.batch = batch

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def on_step(self, sequences: int, rows: int) -> None:
        self.step_sequences.observe(sequences)
        self.step_tokens.observe(rows)

    def on_finish(self, handle, result) -> None:
        """BatchEngine's hook (engine thread): one finished request. result is None for a
        request that never ran (cancelled or aborted while waiting): it produced nothing."""
        if result is None:
            return
        stats = result.stats
        self.success.labels(*self.values, FINISH.get(stats.finish_reason, stats.finish_reason)).inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(len(result.token_ids))
        self.draft_tokens.inc(stats.drafted)
        self.accepted_tokens.inc(stats.accepted)
        # drafted_pos[0] counts the rounds that drafted position 0, i.e. drafted anything
        self.drafts.inc(stats.drafted_pos[0] if stats.drafted_pos else 0)
        for pos, n in enumerate(stats.accepted_pos):
            self.accepted_per_pos.labels(*self.values, str(pos)).inc(n)
        self._timings(handle, len(result.token_ids))

    def _timings(self, handle, tokens: int) -> None:
        end = time.monotonic()
        self.e2e.observe(end - handle.submitted)
        if handle.first_token_at is not None:
            self.ttft.observe(handle.first_token_at - handle.submitted)
            if tokens > 1:
                self.tpot.observe((end - handle.first_token_at) / (tokens - 1))


class _Gauges:
    """Scheduler state read at scrape time."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self):
        return []  # names are checked at collect time; the batch engine may not exist yet

    def collect(self):
        batch, values = self.metrics.batch, self.metrics.values
        running, waiting = batch.counts() if batch is not None else (0, 0)
        kv = batch.kv_state() if batch is not None else {}
        for name, doc, value in (
                ("num_requests_running", "Requests in the running batch.", running),
                ("num_requests_waiting", "Requests waiting to be admitted.", waiting),
                ("kv_cache_usage_perc", "Fraction of the target's KV pool reserved (0-1), the prefix "
                                        "cache's sequences included.", kv.get("usage", 0.0)),
                ("kv_cache_request_usage_perc", "Fraction of the target's KV positions filled by requests "
                                                "(0-1), the prefix cache's excluded.", kv.get("request_usage", 0.0)),
                ("kv_cache_sequences", "Sequences held in the target's KV pool.", kv.get("sequences", 0)),
                ("prefix_cache_sequences", "Finished requests' sequences kept for their prefix.",
                 kv.get("prefix_sequences", 0))):
            family = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
            family.add_metric(values, value)
            yield family
