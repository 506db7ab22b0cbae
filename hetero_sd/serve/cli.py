"""`hetero-sd serve`: the OpenAI-compatible HTTP server (needs the `server` extra).

Wired into hetero_sd/cli.py by `add_parser(subparsers)`; `run(args)` returns
the exit status and raises HeteroSDError subclasses for the CLI to print.

Shutdown order on SIGTERM (or Ctrl-C): admission stops and running requests
finish or end with finish_reason "abort" (BatchEngine.shutdown) BEFORE uvicorn
waits for open connections to close, since a streaming response keeps its
connection open until its final chunk; then the engine's workers stop, and the
process exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

from hetero_sd.errors import HeteroSDError


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API (continuous batching)",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics with "
                    "continuous batching. Needs the server extra: pip install 'hetero-sd[server]'.")
    p.add_argument("--config", help="YAML config (default: the packaged configs/cpu.yaml)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this host only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port, printed)")
    p.add_argument("--api-key", action="append", metavar="KEY[=PRIORITY]",
                   help="require Authorization: Bearer KEY on every endpoint but /health; repeat for "
                        "several keys, each optionally with the priority its requests get when they name "
                        "none (e.g. --api-key batch-jobs=-1 --api-key interactive=5). "
                        "Default: $HETERO_SD_API_KEY; none = open")
    p.add_argument("--max-running", type=_positive, default=16, help="requests stepped together (default 16)")
    p.add_argument("--max-waiting", type=_positive, default=64,
                   help="waiting-queue bound; past it requests get 429 (default 64)")
    p.add_argument("--prefix-cache", type=int, default=8, metavar="N",
                   help="keep up to N finished requests' KV for prompts that begin alike (exact: onnxruntime "
                        "targets only; 0 = off; default 8)")
    p.add_argument("--kv-budget", help="override memory.kv_budget (the target's KV pool), e.g. 1GiB")
    p.add_argument("--drain-s", type=_seconds, default=30.0,
                   help="on SIGTERM, seconds running requests get to finish before they are aborted (default 30)")
    p.add_argument("--no-speculation", action="store_true",
                   help="target-only decoding (the drafter section is ignored and not loaded)")
    p.add_argument("--model-name", help="the name /v1/models reports (default: the target model's name)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning; info adds an access log)")
    p.add_argument("--progress", action="store_true", help="show load progress even when stderr is not a TTY")
    p.set_defaults(func=run)


def api_keys(given: list[str] | None) -> dict[str, float]:
    """KEY or KEY=PRIORITY (an integer after the last '='; otherwise the whole text is
    the key, so base64 keys ending in '=' stay whole) -> {key: default priority}."""
    keys: dict[str, float] = {}
    env = os.environ.get("HETERO_SD_API_KEY")
    for item in given or ([env] if env else []):
        key, sep, prio = item.rpartition("=")
        if sep and key and prio.lstrip("-").isdigit():
            keys[key] = float(int(prio))
        elif item:
            keys[item] = 0.0
    return keys


def model_name(cfg) -> str:
    """A catalog name as given (resolved from an alias); a path by its file or folder name."""
    from hetero_sd import catalog

    entry = catalog.find(cfg.target.model)
    return entry.name if entry is not None else Path(cfg.target.model).name


def _need_server_extra() -> None:
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if _absent(m)]
    if missing:
        raise HeteroSDError(f"hetero-sd serve needs {', '.join(missing)}: pip install 'hetero-sd[server]' "
                            "(or pip install -e \".[server]\" from a checkout)")


def _absent(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


def run(args) -> int:
    _need_server_extra()  # before any model loads
    from hetero_sd.config import load_config
    from hetero_sd.engine import Engine
    from hetero_sd.serve.app import ServerState

    cfg = load_config(args.config, {"memory.kv_budget": args.kv_budget})
    engine = Engine.from_config(cfg, progress=sys.stderr.isatty() or args.progress,
                                target_only=args.no_speculation)
    try:
        state = ServerState(engine, args.model_name or model_name(cfg), max_running=args.max_running,
                            max_waiting=args.max_waiting, api_key=api_keys(args.api_key), drain_s=args.drain_s,
                            prefix_cache=max(0, args.prefix_cache),
                            speculate=not args.no_speculation)
    except BaseException:
        engine.close()
        raise
    try:
        _serve(state, args)
    finally:
        state.close()  # idempotent: the app's lifespan normally did it already
    return 0


def _serve(state, args) -> None:
    import uvicorn

    from hetero_sd.serve.app import create_app

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:  # the line a supervisor (or a test) waits for; --port 0 shows the real port
                port = self.servers[0].sockets[0].getsockname()[1]
                host = f"[{args.host}]" if ":" in args.host else args.host
                print(f"serving {state.model_name} on http://{host}:{port}", file=sys.stderr, flush=True)

        async def shutdown(self, sockets=None):
            # Streams end (finished or aborted, each with its final chunk) before uvicorn
            # waits for their connections; new requests meanwhile get 503, /health 503.
            await asyncio.to_thread(state.drain)
            await super().shutdown(sockets)

    config = uvicorn.Config(create_app(state), host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.log_level in ("info", "debug"), lifespan="on",
                            timeout_graceful_shutdown=10)
    # uvicorn re-raises the signal it caught once it has shut down, with the handler that was
    # in place before it: a no-op here, so a SIGTERM ends the process with status 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        Server(config).run()
    except SystemExit as exc:  # uvicorn exits 1 when it cannot bind (its error is logged above)
        if exc.code:
            raise HeteroSDError(f"could not serve on {args.host}:{args.port}") from None
