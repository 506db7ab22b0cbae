"""One target for every path, on a real model: `generate --target-only` against the
server, target-only and speculating, each request alone and 8 at a time.

    python benchmarks/check_paths.py [--config configs/cpu.yaml] [--prompts default,code]
                                     [--max-tokens 64] [--together 8] [--json FILE]

Every packaged prompt (chat template, greedy) is answered first by the Python API
that `hetero-sd generate --target-only` runs, then by `hetero-sd serve
--no-speculation` and by `hetero-sd serve` (speculating, the config's drafter),
each over HTTP (/v1/chat/completions), one request at a time and then `--together`
at once. A served answer counts as equal when its text is the command line's,
character for character. Not a test (a real model, minutes on 2 cores): its counts
are reported (docs/serving.md); the goal is every prompt on every path.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_procs import HOST, free_port, serving  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def command_line(config: str, prompts: list[str], max_tokens: int) -> list[str]:
    from hetero_sd.engine import Engine

    engine = Engine.from_config(config, target_only=True, progress=True)
    out = [engine.generate(p, max_tokens, target_only=True, chat_template=True, temperature=0).text
           for p in prompts]
    engine.close()
    return out


async def _ask(client, base: str, model: str, prompt: str, max_tokens: int) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}
    resp = await client.post(f"{base}/v1/chat/completions", json=body)
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"]["content"]


async def _served(base: str, model: str, prompts: list[str], max_tokens: int, together: int) -> list[str]:
    import httpx

    async with httpx.AsyncClient(timeout=1800) as client:
        out: list[str] = []
        for i in range(0, len(prompts), together):
            out += await asyncio.gather(*(_ask(client, base, model, p, max_tokens) for p in prompts[i:i + together]))
        return out


def server(config: str, speculate: bool, prompts: list[str], opts, log: Path) -> dict[str, list[str]]:
    port = free_port()
    argv = [sys.executable, "-m", "hetero_sd.cli", "serve", "--config", config, "--host", HOST, "--port", str(port),
            "--max-running", str(opts.together)] + ([] if speculate else ["--no-speculation"])
    with serving(argv, port, log, 1800) as (base, model):
        return {"alone": asyncio.run(_served(base, model, prompts, opts.max_tokens, 1)),
                f"{opts.together} at a time": asyncio.run(_served(base, model, prompts, opts.max_tokens,
                                                                  opts.together))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "cpu.yaml"))
    ap.add_argument("--prompts", default="default,code", help="packaged prompt sets (or files), comma-separated")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--together", type=int, default=8)
    ap.add_argument("--limit", type=int, help="only the first N prompts (smoke runs)")
    ap.add_argument("--json", help="write the counts and every differing answer here")
    opts = ap.parse_args(argv)
    opts.config = str(Path(opts.config).resolve())  # (the servers run in another folder)
    from hetero_sd.bench.prompts import load_prompts

    prompts = [p.prompt for name in opts.prompts.split(",") for p in load_prompts(name.strip())][:opts.limit]
    want = command_line(opts.config, prompts, opts.max_tokens)
    gc.collect()
    logdir = Path(tempfile.mkdtemp(prefix="check-paths-"))
    report = {"config": opts.config, "prompts": len(prompts), "max_tokens": opts.max_tokens, "paths": {}}
    for speculate in (False, True):
        name = "serve" if speculate else "serve --no-speculation"
        for how, got in server(opts.config, speculate, prompts, opts, logdir / f"{speculate}.log").items():
            differ = [{"prompt": p, "generate": w, "served": g} for p, w, g in zip(prompts, want, got) if w != g]
            report["paths"][f"{name}, {how}"] = {"equal": len(prompts) - len(differ), "differ": differ}
    print(f"| path ({Path(opts.config).name}, {len(prompts)} prompts, {opts.max_tokens} tokens) | "
          f"equal to generate --target-only |\n|---|---|")
    for path, r in report["paths"].items():
        print(f"| {path} | {r['equal']}/{len(prompts)} |")
    if opts.json:
        Path(opts.json).write_text(json.dumps(report, indent=1))
    return 0 if all(not r["differ"] for r in report["paths"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
