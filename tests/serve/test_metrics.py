"""Issue 15, point 5: after a known run, /metrics parses with prometheus_client's parser and
the drafted and accepted token counters equal the sum of the requests' own `speculation`."""
from __future__ import annotations

import pytest

import httpx

from prometheus_client.parser import text_string_to_metric_families

from helpers.serving import metric, parse_sse

RAW = "the cat sat on the mat. " * 6  # the n-gram drafter proposes on it
REQUESTS = [
    ("/v1/completions", {"prompt": RAW, "max_tokens": 30, "temperature": 0}),
    ("/v1/completions", {"prompt": RAW, "max_tokens": 30, "temperature": 0.7, "seed": 1, "stream": True}),
    ("/v1/completions", {"prompt": "one two three one two three one two", "max_tokens": 20}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "stream": True}),
]
# vLLM's exposed series, with hetero_sd: for vllm:
SERIES = ["spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
          "spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_per_pos_total",
          "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
          "generation_tokens_total", "time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket",
          "e2e_request_latency_seconds_bucket", "request_success_total"]
COUNTED = {"drafted": "hetero_sd:spec_decode_num_draft_tokens_total",
           "accepted": "hetero_sd:spec_decode_num_accepted_tokens_total"}


def run(http: httpx.Client, path: str, body: dict) -> tuple[dict, dict]:
    """(usage, speculation) of one request, streamed or not."""
    if not body.get("stream"):
        out = http.post(path, json=body).raise_for_status().json()
        return out["usage"], out["speculation"]
    body = {**body, "stream_options": {"include_usage": True}}
    with http.stream("POST", path, json=body) as resp:
        events = parse_sse(resp.iter_lines())
    assert events[-1] == "[DONE]"
    final = next(e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"])
    return events[-2]["usage"], final["speculation"]


@pytest.fixture(scope="module")
def known_run(server):
    """The /metrics text before and after the REQUESTS, and their summed fields."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        before = http.get("/metrics").text
        sums = {"drafted": 0, "accepted": 0, "prompt_tokens": 0, "completion_tokens": 0}
        for path, body in REQUESTS:
            usage, spec = run(http, path, body)
            for key in sums:
                sums[key] += spec[key] if key in spec else usage[key]
        after = http.get("/metrics").text
    return before, after, sums


def delta(known_run, name: str, **labels) -> float:
    before, after, _ = known_run
    return metric(after, name, **labels) - metric(before, name, **labels)


def test_metrics_parse_with_vllm_names_and_placement_labels(known_run):
    _, after, _ = known_run
    families = list(text_string_to_metric_families(after))
    names = {s.name for f in families for s in f.samples}
    assert {f"hetero_sd:{n}" for n in SERIES} <= names, sorted(names)
    for family in families:
        assert family.name.startswith("hetero_sd:")
        for sample in family.samples:
            assert {"model_name", "target", "drafter"} <= set(sample.labels), sample
            assert sample.labels["target"] == "torch:cpu:fp32" and sample.labels["drafter"] == "ngram"


def test_token_counters_equal_the_requests_own_stats(known_run):
    _, _, sums = known_run
    assert sums["drafted"] > 0 and sums["accepted"] > 0  # a run that did speculate
    for key, name in COUNTED.items():
        assert delta(known_run, name) == sums[key], key
    assert delta(known_run, "hetero_sd:prompt_tokens_total") == sums["prompt_tokens"]
    assert delta(known_run, "hetero_sd:generation_tokens_total") == sums["completion_tokens"]
    # per position: accepted at each draft position adds up to the accepted tokens
    assert delta(known_run, "hetero_sd:spec_decode_num_accepted_tokens_per_pos_total") == sums["accepted"]
    drafts = delta(known_run, "hetero_sd:spec_decode_num_drafts_total")
    assert 0 < drafts <= sums["drafted"]


def test_latency_histograms_and_gauges(known_run):
    n = len(REQUESTS)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds"):
        assert delta(known_run, f"hetero_sd:{name}_count") == n, name
    assert delta(known_run, "hetero_sd:request_success_total") == n
    _, after, _ = known_run
    assert metric(after, "hetero_sd:num_requests_running") == 0
    assert metric(after, "hetero_sd:num_requests_waiting") == 0
    assert metric(after, "hetero_sd:kv_cache_usage_perc") == 0
