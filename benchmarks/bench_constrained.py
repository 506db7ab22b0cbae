"""Constrained decoding (JSON Schema) under speculation, against OpenVINO GenAI's
structured output, interleaved prompt by prompt.

    python benchmarks/bench_constrained.py [--config X] [--reps 2] [--max-new-tokens 160]
                                           [--out /tmp/bench-constrained] [--peer/--no-peer] [--limit N]
                                           [--prompts FILE] [--peer-model GGUF]

One engine is built from --config (default: the packaged configs/cpu.yaml);
its target-only runs use `target_only=True` on that same engine. For each
repetition and prompt of benchmarks/json_extract_prompts.jsonl ("extract ...
as JSON" with a JSON Schema), every configuration runs back to back in a
rotating order: ours target-only and speculative (the config's drafter), each
with the prompt's json_schema constraint and without one, and GenAI's
LLMPipeline on the same GGUF with its exact hints, plain greedy and prompt
lookup, each with its structured output (StructuredOutputConfig(json_schema))
and without. Every run gets the same token ids (our chat template) and stops
at EOS or at max_new_tokens; ours also stops where the grammar's language
ends, while GenAI's grammar forces one more token, EOS (dropped from its
count, its time kept).

Reported per configuration: tok/s (new tokens / wall of the call) and decode
tok/s, geometric means over prompts; acceptance and accepted drafts per round;
the grammar's mask cost per token; validity (json.loads and jsonschema.validate
against the prompt's schema; a truncated output is invalid); and for
speculative runs whether the tokens equal the same system's greedy run with
the same constraint. Ratios pair runs of the same prompt and repetition
(geometric mean, bootstrap 95% interval). Writes constrained.{json,md} to
--out. Not a test: speed is measured, never asserted.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_genai import _ratios  # noqa: E402

from hetero_sd.bench.common import WARMUP_PROMPT, Workload  # noqa: E402
from hetero_sd.bench.genai_peer import EXACT_HINTS, _config, _generate, _import, _pipeline, _sample, genai_model  # noqa: E402,E501
from hetero_sd.bench.ours import _placement  # noqa: E402
from hetero_sd.bench.prompts import Prompt  # noqa: E402
from hetero_sd.bench.runner import _peer_spec  # noqa: E402
from hetero_sd.config import load_config  # noqa: E402
from hetero_sd.constraint import Constraint  # noqa: E402

PROMPTS = Path(__file__).resolve().parent / "json_extract_prompts.jsonl"
GOAL = 1.5  # constrained speculative / constrained target-only
JSON = " [json]"  # a configuration name's suffix when the output is held to the schema


def load_prompts(path: Path, limit: int | None = None) -> list[dict]:
    """{"id", "source", "prompt", "schema"} per line; every schema checked before anything loads."""
    import jsonschema

    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        p = json.loads(line)
        missing = {"id", "prompt", "schema"} - set(p)
        if missing:
            raise SystemExit(f"{path}:{n}: missing {', '.join(sorted(missing))}")
        jsonschema.validators.validator_for(p["schema"]).check_schema(p["schema"])
        p.setdefault("source", "ours" if p.get("ours") else "heldout-style")
        out.append(p)
    return out[:limit] if limit else out


def validity(text: str, schema: dict) -> tuple[bool, str]:
    """(valid, why not): the whole output parses as JSON and satisfies the schema."""
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return False, f"not JSON: {exc.msg} at char {exc.pos}"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        return False, f"schema: {exc.message}"[:200]
    return True, ""


def config_names(mode: str, peer: bool) -> tuple[list[str], dict[str, str]]:
    """Every configuration, and for each speculative one the same system's greedy run."""
    names, greedy = [], {}
    for c in (JSON, ""):
        names += [f"ours target-only{c}", f"ours {mode}{c}"]
        greedy[f"ours {mode}{c}"] = f"ours target-only{c}"
        if peer:
            names += [f"genai plain{c}", f"genai prompt-lookup{c}"]
            greedy[f"genai prompt-lookup{c}"] = f"genai plain{c}"
    return names, greedy


def record(name: str, rep: int, p: dict, tokens: list[int], text: str, wall: float, prefill: float,
           finish: str, stats=None) -> dict:
    ok, why = validity(text, p["schema"])
    n = len(tokens)
    r = {"run": name, "rep": rep, "id": p["id"], "source": p["source"], "new_tokens": n, "token_ids": tokens,
         "text": text, "total_s": wall, "prefill_s": prefill, "finish": finish, "valid": ok, "invalid": why,
         "tok_s": n / wall if wall > 0 else 0.0,
         "decode_tok_s": (n - 1) / (wall - prefill) if n > 1 and wall > prefill else None}
    if stats is not None:
        r.update({k: getattr(stats, k, 0) for k in ("drafted", "accepted", "rounds", "draft_s", "verify_s", "mask_s",
                                                    "mask_wait_s", "grammar_cut", "grammar_drafted")})
    return r


def run_ours(engine, name: str, rep: int, p: dict, ids: list[int], max_new: int) -> dict:
    constraint = Constraint.json_schema(p["schema"]) if name.endswith(JSON) else None
    t0 = time.perf_counter()
    res = engine.generate_ids(ids, max_new, target_only="target-only" in name, stop=[], constraint=constraint)
    wall = time.perf_counter() - t0
    s = res.stats  # the first token came after the call's setup (grammar copy) and the prefill
    return record(name, rep, p, list(res.token_ids), res.text, wall, s.prefill_s + max(0.0, wall - s.total_s),
                  s.finish_reason, s)


def run_genai(ov, pipe, cfg, tokenizer, work: Workload, name: str, rep: int, p: dict, ids: list[int]) -> dict:
    res, wall = _generate(ov, pipe, cfg, ids, work.max_new_tokens)
    s = _sample(Prompt(p["id"], p["source"], p["prompt"]), ids, res, wall, work)  # EOS dropped, TTFT read
    text = tokenizer.decode(s.token_ids, skip_special_tokens=True)
    return record(name, rep, p, s.token_ids, text, wall, s.prefill_s, s.finish)


def _geo(values) -> float | None:
    values = [v for v in values if v]
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


def summarize(records: list[dict], names: list[str], greedy: dict[str, str], mode: str) -> dict:
    """Per configuration figures, and the paired ratios."""
    by = {(r["run"], r["rep"], r["id"]): r for r in records if "error" not in r}
    for r in records:  # speculative output vs the same system's greedy with the same constraint
        ref = by.get((greedy.get(r["run"]), r["rep"], r["id"]))
        if r["run"] in greedy and "error" not in r:
            r["equal_greedy"] = None if ref is None else r["token_ids"] == ref["token_ids"]
    configs = {}
    for name in names:
        rs = [r for r in records if r["run"] == name and "error" not in r]
        errors = [r["error"] for r in records if r["run"] == name and "error" in r]
        if not rs:
            configs[name] = {"runs": 0, "errors": errors}
            continue
        tot = lambda k: sum(r.get(k) or 0 for r in rs)  # noqa: E731
        row = {"runs": len(rs), "errors": errors, "tok_s": _geo(r["tok_s"] for r in rs),
               "decode_tok_s": _geo(r["decode_tok_s"] for r in rs), "new_tokens": tot("new_tokens"),
               "valid": sum(r["valid"] for r in rs),
               "valid_by_source": {s: [sum(r["valid"] for r in rs if r["source"] == s),
                                       sum(r["source"] == s for r in rs)] for s in sorted({r["source"] for r in rs})},
               "ended": sum(r["finish"] in ("grammar", "eos") for r in rs)}
        if "rounds" in rs[0] and tot("drafted"):
            row.update(acceptance=tot("accepted") / tot("drafted"), accepted_per_round=tot("accepted") / tot("rounds"),
                       grammar_cut=tot("grammar_cut"), grammar_drafted=tot("grammar_drafted"))
        if name.startswith("ours") and name.endswith(JSON):
            compute = tot("prefill_s") + tot("draft_s") + tot("verify_s")  # verify_s already holds the wait
            row.update(mask_ms_per_token=1e3 * tot("mask_s") / max(1, tot("new_tokens")),
                       mask_of_compute=tot("mask_s") / compute, wait_of_wall=tot("mask_wait_s") / tot("total_s"))
        if name in greedy:
            flags = [r.get("equal_greedy") for r in rs if r.get("equal_greedy") is not None]
            row["equal_greedy"], row["compared"] = sum(flags), len(flags)
        configs[name] = row
    pairs = [(f"ours {mode}{JSON}", f"ours target-only{JSON}"), (f"ours {mode}", "ours target-only"),
             (f"ours target-only{JSON}", "ours target-only"), (f"genai prompt-lookup{JSON}", f"genai plain{JSON}"),
             ("genai prompt-lookup", "genai plain"), (f"genai plain{JSON}", "genai plain"),
             (f"ours {mode}{JSON}", f"genai plain{JSON}"), (f"ours {mode}{JSON}", f"genai prompt-lookup{JSON}")]
    ratios = {}
    for a, b in pairs:
        both = [(r, by[(b, r["rep"], r["id"])]) for r in records
                if r["run"] == a and "error" not in r and (b, r["rep"], r["id"]) in by]
        both = [(x, y) for x, y in both if x["tok_s"] and y["tok_s"]]
        if not both:
            continue
        dec = [(x["decode_tok_s"], y["decode_tok_s"]) for x, y in both if x["decode_tok_s"] and y["decode_tok_s"]]
        ratios[f"{a} / {b}"] = {"pairs": len(both), "tok_s": _ratios([(x["tok_s"], y["tok_s"]) for x, y in both]),
                                "decode_tok_s": _ratios(dec) if dec else None}
    return {"configs": configs, "ratios": ratios}


def to_markdown(summary: dict, meta: dict) -> str:
    f = lambda v, spec=".1f": "-" if v is None else format(v, spec)  # noqa: E731
    ci = lambda r: "-" if r is None else f"{r['ratio']:.2f}x [{r['low']:.2f}, {r['high']:.2f}]"  # noqa: E731
    lines = [f"Constrained decoding (JSON Schema) on {meta['model']}, {meta['target']}, drafter {meta['drafter']}; "
             f"{meta['prompts']} extraction prompts ({meta['ours']} ours, {meta['prompts'] - meta['ours']} "
             f"heldout-style) x {meta['reps']} repetitions, up to {meta['max_new_tokens']} new tokens, stopping at "
             f"EOS or where the grammar ends; every configuration back to back per prompt, rotating order. "
             f"[json] = output held to the prompt's schema (ours: llguidance; GenAI {meta['genai'] or '-'}: "
             f"StructuredOutputConfig, exact hints, prompt lookup {meta['peer_spec']}).", "",
             "| run | tok/s | decode tok/s | acceptance | accepted/round | drafts cut/forced | mask ms/token | "
             "mask/compute | wait/wall | valid (ours, heldout-style) | ended | = greedy |", "|---" * 12 + "|"]
    for name, r in summary["configs"].items():
        if not r["runs"]:
            lines.append(f"| {name} | failed: {r['errors'][0][:120] if r['errors'] else 'no runs'} |" + " |" * 10)
            continue
        src = r["valid_by_source"]  # in the header's order: ours, heldout-style (then any other source)
        order = [s for s in ("ours", "heldout-style") if s in src] + sorted(set(src) - {"ours", "heldout-style"})
        vs = " ".join(f"{src[s][0]}/{src[s][1]}" for s in order)
        mask = [f(r.get("mask_ms_per_token"), ".3f"), f(r.get("mask_of_compute"), ".1%"), f(r.get("wait_of_wall"), ".2%")]
        eq = f"{r['equal_greedy']}/{r['compared']}" if "compared" in r else "-"
        cut = f"{r['grammar_cut']}/{r['grammar_drafted']}" if name.endswith(JSON) and "grammar_cut" in r else "-"
        lines.append(f"| {name} | {f(r['tok_s'])} | {f(r['decode_tok_s'])} | {f(r.get('acceptance'), '.0%')} | "
                     f"{f(r.get('accepted_per_round'), '.2f')} | {cut} | {' | '.join(mask)} | {r['valid']}/{r['runs']} ({vs}) | "
                     f"{r['ended']}/{r['runs']} | {eq} |" + (f" ({len(r['errors'])} failed)" if r["errors"] else ""))
    lines += ["", "| ratio (same prompt, same repetition) | tok/s | decode tok/s | pairs |", "|---|---|---|---|"]
    for name, r in summary["ratios"].items():
        lines.append(f"| {name} | {ci(r['tok_s'])} | {ci(r['decode_tok_s'])} | {r['pairs']} |")
    head = summary["ratios"].get(f"ours {meta['mode']}{JSON} / ours target-only{JSON}")
    if head:
        r = head["tok_s"]
        met = "met" if r["low"] >= GOAL else "not met" if r["high"] < GOAL else \
            f"not shown (the estimate is {'above' if r['ratio'] >= GOAL else 'below'}, the interval spans it)"
        lines += ["", f"Goal: constrained speculative / constrained target-only >= {GOAL}x: {met} "
                  f"({ci(head['tok_s'])} tok/s)."]
    lines += ["", "tok/s = new tokens / wall of the call (prefill included), decode tok/s = (new - 1) / (wall - time "
              "to first token); geometric means over prompts and repetitions. Ratios: geometric mean of per-prompt "
              "ratios [bootstrap 95% interval]. acceptance = accepted / drafted drafts (GenAI's prompt lookup reports "
              "none); drafts cut/forced = drafts the grammar refused (dropped before the verify) / drafts it forced "
              "(schema keys, punctuation appended to a short proposal). mask ms/token = all grammar-mask time (llguidance, on a helper thread overlapping the target's "
              "forward) / new tokens; mask/compute = that time / (prefill + draft + verify time), the share of the "
              "model work it would be if nothing overlapped; wait/wall = the part the engine actually waited for "
              "after the forward / the call's wall time. valid = json.loads and jsonschema.validate both pass (an "
              "output cut at max_new_tokens is invalid); ended = stopped at EOS or the grammar's end, not at "
              "max_new_tokens. = greedy: speculative tokens equal to the same system's greedy run with the same "
              "constraint (ours: speculative vs target-only; GenAI: prompt lookup vs plain)."]
    for name, why in meta.get("skipped", {}).items():
        lines.append(f"- skipped {name}: {why}")
    return "\n".join(lines) + "\n"


def _why(exc: Exception) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]  # C++ messages span lines: one


def _warm_ours(engine, warm_ids, prompts) -> None:
    for target_only in (True, False):
        engine.generate_ids(warm_ids, 8, target_only=target_only, stop=[])
        for p in prompts:  # compile every schema once (cached by the engine), outside the measured calls
            engine.generate_ids(warm_ids, 2, target_only=target_only, stop=[],
                                constraint=Constraint.json_schema(p["schema"]))


def _genai(ov_genai, model: str, prompts, work: Workload, spec: dict, skipped: dict) -> dict:
    """name -> (pipeline, {prompt id: generation config}); a part that fails is skipped, never fatal."""
    out = {}
    for variant in ("plain", "prompt-lookup"):
        try:
            pipe = _pipeline(ov_genai, model, None, variant, EXACT_HINTS)
        except Exception as exc:  # noqa: BLE001 - reported
            for c in (JSON, ""):
                skipped[f"genai {variant}{c}"] = _why(exc)
            continue
        for c in (JSON, ""):
            cfgs = {}
            for p in prompts:
                cfg = _config(pipe, variant, work, spec)
                if c:
                    cfg.structured_output_config = ov_genai.StructuredOutputConfig(json_schema=json.dumps(p["schema"]))
                cfgs[p["id"]] = cfg
            out[f"genai {variant}{c}"] = (pipe, cfgs)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="YAML configuration (default: the packaged configs/cpu.yaml)")
    ap.add_argument("--prompts", default=str(PROMPTS), help="JSONL of {id, source, prompt, schema}")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    ap.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True, help="OpenVINO GenAI runs")
    ap.add_argument("--peer-model", default=None,
                    help="the GGUF or OpenVINO IR folder GenAI reads (default: the config's target model)")
    ap.add_argument("--out", default="/tmp/bench-constrained")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.max_new_tokens < 2:
        ap.error("need --reps >= 1 and --max-new-tokens >= 2")
    prompts = load_prompts(Path(args.prompts), args.limit)
    cfg = load_config(args.config, {"generation.max_new_tokens": args.max_new_tokens})
    if cfg.drafter.kind == "none":
        ap.error(f"{cfg.source}: the configuration has no drafter; nothing to speculate with")
    from hetero_sd.engine import Engine

    print(f"loading {cfg.source} ...", file=sys.stderr)
    engine = Engine.from_config(cfg, progress=True)
    engine.constraint = None  # each run says its own (a YAML default would hold the free runs too)
    mode = engine.drafter.name
    ids = {p["id"]: engine.encode(p["prompt"]) for p in prompts}
    warm_ids = engine.encode(WARMUP_PROMPT)
    _warm_ours(engine, warm_ids, prompts)
    names, greedy = config_names(mode, args.peer)
    model_path = Path(_placement(cfg)[0])
    spec = _peer_spec([cfg], model_path)
    peer_path = Path(args.peer_model).resolve() if args.peer_model else model_path
    work = Workload([], ids, warm_ids, args.max_new_tokens, "stop", tuple(sorted(engine.eos_ids)))
    skipped, peers, version = {}, {}, None
    if args.peer:
        try:
            ov, ov_genai = _import()
            version = ov_genai.__version__
            peers = _genai(ov_genai, genai_model(peer_path), prompts, work, spec, skipped)
            for name, (pipe, cfgs) in list(peers.items()):  # warm-up: every grammar compiled once, not measured
                try:
                    for p in prompts:
                        _generate(ov, pipe, cfgs[p["id"]], warm_ids, 2 if name.endswith(JSON) else 8)
                except Exception as exc:  # noqa: BLE001 - that configuration is reported, never fatal
                    skipped[name] = _why(exc)
                    del peers[name]
        except Exception as exc:  # noqa: BLE001 - the peer is reported, never fatal
            why = _why(exc)
            skipped |= {n: why for n in names if n.startswith("genai") and n not in skipped}
            peers = {}
        names = [n for n in names if not n.startswith("genai") or n in peers or n in skipped]

    records = []
    bar = tqdm(total=args.reps * len(prompts) * len(names), desc="constrained", unit="run", file=sys.stderr)
    for rep in range(args.reps):
        for i, p in enumerate(prompts):
            shift = (rep + i) % len(names)
            for name in names[shift:] + names[:shift]:
                if name in skipped:
                    bar.update()
                    continue
                try:
                    if name.startswith("ours"):
                        records.append(run_ours(engine, name, rep, p, ids[p["id"]], args.max_new_tokens))
                    else:
                        pipe, cfgs = peers[name]
                        records.append(run_genai(ov, pipe, cfgs[p["id"]], engine.tokenizer, work, name, rep, p,
                                                 ids[p["id"]]))
                except Exception as exc:  # noqa: BLE001 - ours raising is a finding: reported, run goes on
                    records.append({"run": name, "rep": rep, "id": p["id"], "source": p["source"],
                                    "error": _why(exc)})
                    tqdm.write(f"{name} {p['id']}: {records[-1]['error']}", file=sys.stderr)
                bar.update()
    bar.close()
    t = cfg.target
    meta = {"config": str(cfg.source), "model": model_path.name, "target": f"{t.backend}:{t.device}:{t.precision}",
            "drafter": f"{cfg.drafter.kind} (k {cfg.drafter.k})", "mode": mode, "reps": args.reps,
            "max_new_tokens": args.max_new_tokens, "prompts": len(prompts),
            "ours": sum(p["source"] == "ours" for p in prompts), "genai": version, "skipped": skipped,
            "peer_model": str(peer_path) if args.peer else None,
            "peer_spec": f"{spec['ngram_k']} tokens, n-gram {spec['max_ngram']}",
            "hints": ", ".join(f"{k}={v}" for k, v in EXACT_HINTS.items())}
    summary = summarize(records, names, greedy, mode)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "constrained.json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": records}, indent=1))
    md = to_markdown(summary, meta)
    (out / "constrained.md").write_text(md)
    print(md)
    engine.close()
    peers.clear()
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
