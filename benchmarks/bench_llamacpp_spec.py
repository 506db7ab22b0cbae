"""llama.cpp's own speculation at its strongest form, its C++ `llama-server`, on the
packaged prompts: plain greedy, its n-gram drafts (`--spec-type ngram-simple`) and
its draft model (`--spec-type draft-simple`, `-md DRAFT`), one request at a time, the
same prompt token ids as `hetero-sd bench` (chat template applied), temperature 0,
EOS ignored, N new tokens:

    python benchmarks/bench_llamacpp_spec.py --llamacpp-bin ~/.cache/llama.cpp/build/bin \
        --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b --prompts code \
        [--max-new-tokens 128] [--ours BENCH_JSON] [--json FILE]

Per mode and prompt kind: llama-server's decode tok/s (its timings.predicted_per_second,
geometric mean over prompts), its acceptance (draft_n_accepted / draft_n), and how
many outputs equal its plain greedy ("= own greedy") and, given `--ours` (a
`hetero-sd bench` bench.json of the same model, prompts and length), our target-only
greedy ("= ours"). Servers start one after another on 127.0.0.1, each warmed up by one
request first. Not a test: speed is measured, never asserted.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_procs import HOST, cores, free_port, serving  # noqa: E402

MODES = ("plain", "ngram-simple", "draft-simple")


def server_argv(bin_dir: Path, model: Path, draft: Path | None, mode: str, port: int, ctx: int,
                extra: str = "") -> list[str]:
    argv = [str(bin_dir / "llama-server"), "--model", str(model), "--host", HOST, "--port", str(port),
            "--threads", str(cores()), "--threads-batch", str(cores()), "--parallel", "1",
            "--ctx-size", str(ctx), "--no-webui"]
    if mode == "ngram-simple":
        argv += ["--spec-type", "ngram-simple"]
    elif mode == "draft-simple":
        if draft is None:
            raise SystemExit("draft-simple needs --draft-model")
        argv += ["--spec-type", "draft-simple", "--model-draft", str(draft),
                 "--threads-draft", str(cores()), "--threads-batch-draft", str(cores())]
    return argv + (shlex.split(extra) if mode != "plain" else [])


def complete(base: str, ids: list[int], new: int) -> dict:
    """One greedy completion of exactly `new` tokens (EOS ignored, no prompt cache)."""
    import httpx

    body = {"prompt": ids, "n_predict": new, "temperature": 0.0, "ignore_eos": True, "cache_prompt": False,
            "return_tokens": True, "stream": False}
    got = httpx.post(f"{base}/completion", json=body, timeout=600).json()
    if "timings" not in got or "tokens" not in got:
        raise RuntimeError(f"llama-server answered without timings or tokens: {str(got)[:300]}")
    return got


def main(argv: list[str] | None = None) -> dict:
    from hetero_sd.bench.prompts import load_prompts
    from hetero_sd.config import resolve_model
    from hetero_sd.engine import encode_text
    from hetero_sd.ir import load_model_ir

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llamacpp-bin", required=True, type=Path)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--prompts", default="code")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--spec-args", default="", help="more llama-server flags for the speculative modes, "
                    "e.g. '--spec-draft-n-max 4'")
    ap.add_argument("--ours", type=Path, default=None, help="a hetero-sd bench bench.json to compare outputs with")
    ap.add_argument("--json", type=Path, default=None)
    opts = ap.parse_args(argv)
    # checked before any server starts, so a bad flag loses no mode's measurements
    modes = opts.modes.split(",")
    if any(m not in MODES for m in modes):
        ap.error(f"--modes {opts.modes!r}: each one of {', '.join(MODES)}")
    if "draft-simple" in modes and not opts.draft_model:
        ap.error("mode draft-simple needs --draft-model (or leave it out of --modes)")
    if not (opts.llamacpp_bin / "llama-server").is_file():
        ap.error(f"no llama-server in {opts.llamacpp_bin} (docs/benchmarks.md builds it)")
    model = Path(resolve_model(opts.model, None))
    draft = Path(resolve_model(opts.draft_model, None)) if opts.draft_model else None
    prompts = load_prompts(opts.prompts)
    tok = load_model_ir(model).load_tokenizer()
    ids = {p.id: encode_text(tok, p.prompt, chat_template=True) for p in prompts}
    ours = {}
    if opts.ours:
        ours = {r["id"]: r["token_ids"] for r in json.loads(opts.ours.read_text())["results"]
                if r["run"] == "ours target-only"}
    ctx = max(len(v) for v in ids.values()) + opts.max_new_tokens + 64
    out: dict = {"model": model.name, "draft": draft.name if draft else None, "threads": cores(), "runs": {}}
    for mode in modes:
        port = free_port()
        log = Path(tempfile.gettempdir()) / f"llama-server-{mode}.log"
        rows = []
        with serving(server_argv(opts.llamacpp_bin, model, draft, mode, port, ctx, opts.spec_args), port, log, 600) as (base, _):
            complete(base, ids[prompts[0].id][:32], 8)  # warm-up
            for p in prompts:
                got = complete(base, ids[p.id], opts.max_new_tokens)
                t = got["timings"]
                rows.append({"id": p.id, "kind": p.kind, "decode_tok_s": t["predicted_per_second"],
                             "draft_n": t.get("draft_n", 0), "accepted": t.get("draft_n_accepted", 0),
                             "tokens": got["tokens"]})
                print(f"{mode:13s} {p.id:20s} {t['predicted_per_second']:6.1f} tok/s", file=sys.stderr)
        out["runs"][mode] = rows
    plain = {r["id"]: r["tokens"] for r in out["runs"].get("plain", [])}
    print(f"llama-server ({model.name}{', draft ' + draft.name if draft else ''}), {cores()} threads, "
          f"{opts.max_new_tokens} tokens, EOS ignored, greedy\n")
    print("| mode | kind | decode tok/s | acceptance | = own greedy | = ours |\n|---|---|---|---|---|---|")
    for mode, rows in out["runs"].items():
        for kind in sorted({r["kind"] for r in rows}) + ["all"]:
            sel = [r for r in rows if kind in ("all", r["kind"])]
            drafted = sum(r["draft_n"] for r in sel)
            acc = f"{sum(r['accepted'] for r in sel) / drafted:.0%}" if drafted else "-"
            same = f"{sum(r['tokens'] == plain.get(r['id']) for r in sel)}/{len(sel)}" if plain else "-"
            vs_ours = f"{sum(r['tokens'] == ours.get(r['id']) for r in sel)}/{len(sel)}" if ours else "-"
            print(f"| {mode} | {kind} | {statistics.geometric_mean([r['decode_tok_s'] for r in sel]):.1f} | {acc} | {same} | {vs_ours} |")
    if opts.json:
        opts.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
