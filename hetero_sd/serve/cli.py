"""`hetero-sd serve`: the OpenAI-compatible HTTP server (needs the `server` extra).

Wired into hetero_sd/cli.py by `add_parser(subparsers)`; `run(args)` returns
the exit status and raises HeteroSDError subclasses for the CLI to print.

Shutdown order on SIGTERM (or Ctrl-C): admission stops and running requests
finish or end with finish_reason "abort" (BatchEngine.shutdown) BEFORE uvicorn
waits for open connections to close, since a streaming response keeps its
connection open until its final chunk; then the engine's workers stop, and the
process exits 0. Should the batch engine's thread die, /health answers 503, the
server stops and the process exits 3, for a supervisor to restart it.
"""
from __future__ import annotations

import argparse
import asyncio
import math
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
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def _timeout(text: str) -> float:
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


DIED = 3  # the exit status when the batch engine's thread died


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
    p.add_argument("--max-running", type=_positive,
                   help="requests stepped together (default: scheduler.max_running, 16)")
    p.add_argument("--max-waiting", type=_positive,
                   help="waiting-queue bound; past it requests get 429 (default: scheduler.max_waiting, 64)")
    p.add_argument("--prefix-cache", type=_count, default=8, metavar="N",
                   help="keep up to N finished requests' KV for prompts that begin alike (exact: onnxruntime "
                        "targets only; 0 = off; default 8). Entries are kept per API key and cache_salt")
    p.add_argument("--drain-s", type=_seconds, default=30.0,
                   help="on SIGTERM, seconds running requests get to finish before they are aborted (default 30)")
    p.add_argument("--no-speculation", action="store_true",
                   help="target-only decoding (the drafter section is ignored and not loaded)")
    p.add_argument("--model-name", help="the name /v1/models reports (default: the target model's name)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning; info adds an access log)")
    p.add_argument("--progress", action="store_true", help="show load progress even when stderr is not a TTY")
    _safety_flags(p)
    from hetero_sd.flags import add_model_flags

    add_model_flags(p)
    p.set_defaults(func=run)


def _safety_flags(p) -> None:
    """Who may reach the server, and what a client may cost it (docs/serving.md, Running it safely)."""
    from hetero_sd.serve.limits import ServeLimits

    d = ServeLimits()
    p.add_argument("--allow-open", action="store_true",
                   help="serve a non-loopback --host with no API key (refused without this flag)")
    p.add_argument("--allowed-hosts", default="", metavar="H1,H2",
                   help="Host header names served besides localhost/127.0.0.1/::1 ('*' = any); on a loopback "
                        "bind other Hosts get 403 (a DNS-rebinding page); on other binds, checked when given")
    p.add_argument("--header-timeout", type=_timeout, default=d.header_timeout_s, metavar="S",
                   help=f"close a connection that sends no complete request head within S s (default "
                        f"{d.header_timeout_s:g})")
    p.add_argument("--body-timeout", type=_timeout, default=d.body_timeout_s, metavar="S",
                   help=f"408 for a body not complete within S s (default {d.body_timeout_s:g})")
    p.add_argument("--keep-alive", type=_timeout, default=d.keep_alive_s, metavar="S",
                   help=f"close an idle kept-alive connection after S s (default {d.keep_alive_s:g})")
    p.add_argument("--max-connections", type=_positive, default=d.max_connections, metavar="N",
                   help=f"open connections and requests at most; past it, 503 (default {d.max_connections})")
    p.add_argument("--max-body", type=_positive, default=d.max_body, metavar="BYTES",
                   help=f"413 for a request body past BYTES, chunked or not (default {d.max_body})")
    p.add_argument("--stall-timeout", type=_timeout, default=d.stall_timeout_s, metavar="S",
                   help=f"cancel a stream whose client read nothing for S s, freeing its KV (default "
                        f"{d.stall_timeout_s:g})")
    p.add_argument("--request-timeout", type=_timeout, metavar="S",
                   help=f"a request's deadline: past it, it ends with finish_reason \"timeout\", keeping what it "
                        f"produced; a body's `timeout` may lower it (default: scheduler.timeout_ms, else "
                        f"{d.request_timeout_s:g})")
    p.add_argument("--fault-plan", metavar="FILE", help=argparse.SUPPRESS)  # tests only (serve/faults.py)


def api_keys(given: list[str] | None, environ=os.environ) -> dict[str, float]:
    """KEY or KEY=PRIORITY (an integer after the last '='; otherwise the whole text is
    the key, so base64 keys ending in '=' stay whole) -> {key: priority}. An empty or
    blank key (an unset variable expanded) is refused: it would silently mean "open"."""
    env = environ.get("HETERO_SD_API_KEY")
    items = given if given is not None else [] if env is None else [env]
    keys: dict[str, float] = {}
    for n, item in enumerate(items):
        source = "HETERO_SD_API_KEY" if given is None else f"--api-key #{n + 1}"
        key, sep, prio = item.rpartition("=")
        if not (sep and key and prio.lstrip("-").isdigit()):
            key, prio = item, None
        if not key.strip():
            raise HeteroSDError(f"{source} is empty or blank: give a real key, or no key at all "
                                "(an unset variable expands to nothing)")
        if key != key.strip():
            raise HeteroSDError(f"{source} begins or ends with white space; clients would never match it")
        keys[key] = 0.0 if prio is None else float(int(prio))
    return keys


def check_bind(host: str, keys: dict, allow_open: bool) -> None:
    """A server reachable from other machines needs a key, or an explicit --allow-open."""
    from hetero_sd.serve.limits import is_loopback

    if not keys and not is_loopback(host) and not allow_open:
        raise HeteroSDError(f"--host {host} serves other machines, but no API key is set: give --api-key "
                            "(or HETERO_SD_API_KEY), or --allow-open to serve without one")


def _scrub_secrets(keys: dict) -> None:
    """Keep keys out of what worker processes inherit: the environment, and the argv
    that multiprocessing's spawn hands each child."""
    os.environ.pop("HETERO_SD_API_KEY", None)
    for i, arg in enumerate(sys.argv):
        if any(key in arg for key in keys):
            sys.argv[i] = "***"


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
    from hetero_sd import flags
    from hetero_sd.engine import Engine
    from hetero_sd.serve.app import ServerState
    from hetero_sd.serve.faults import FaultPlan
    from hetero_sd.transport import cleanup_stale

    keys = api_keys(args.api_key)
    check_bind(args.host, keys, args.allow_open)
    cfg = flags.load(args)
    limits, sched = _limits(args, cfg.scheduler), cfg.scheduler
    _scrub_secrets(keys)
    cleanup_stale()  # segments a killed process group left in /dev/shm
    engine = Engine.from_config(cfg, progress=sys.stderr.isatty() or args.progress,
                                target_only=args.no_speculation)
    died = []
    try:
        faults = None if args.fault_plan is None else FaultPlan.load(args.fault_plan, engine.tokenizer.decode)
        state = ServerState(engine, args.model_name or model_name(cfg),
                            max_running=args.max_running or sched.max_running,
                            max_waiting=args.max_waiting or sched.max_waiting, api_key=keys, drain_s=args.drain_s,
                            prefix_cache=args.prefix_cache, speculate=not args.no_speculation, limits=limits,
                            bind=args.host, faults=faults, on_death=died.append)
    except BaseException:
        engine.close()
        raise
    try:
        _serve(state, args, died)
    finally:
        state.close()  # idempotent: the app's lifespan normally did it already
    if died:
        print(f"hetero-sd serve: the batch engine died ({died[0]}); exiting {DIED}", file=sys.stderr, flush=True)
        return DIED
    return 0


def _limits(args, sched):
    """The flags' limits; a deadline from the flag, else the config's scheduler.timeout_ms."""
    from hetero_sd.serve.limits import ServeLimits

    timeout = args.request_timeout or (sched.timeout_ms / 1000 if sched.timeout_ms else ServeLimits.request_timeout_s)
    hosts = tuple(h.strip().lower() for h in args.allowed_hosts.split(",") if h.strip())
    return ServeLimits(max_body=args.max_body, header_timeout_s=args.header_timeout,
                       body_timeout_s=args.body_timeout, keep_alive_s=args.keep_alive,
                       max_connections=args.max_connections, stall_timeout_s=args.stall_timeout,
                       request_timeout_s=timeout, allowed_hosts=hosts)


def _serve(state, args, died: list) -> None:
    import uvicorn

    from hetero_sd.serve.app import create_app
    from hetero_sd.serve.limits import connection_class

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:  # the line a supervisor (or a test) waits for; --port 0 shows the real port
                port = self.servers[0].sockets[0].getsockname()[1]
                host = f"[{args.host}]" if ":" in args.host else args.host
                print(f"serving {state.model_name} on http://{host}:{port}", file=sys.stderr, flush=True)

        async def on_tick(self, counter: int) -> bool:
            if died:  # the batch engine is gone: stop serving, so a supervisor restarts the process
                self.should_exit = True
            return await super().on_tick(counter)

        async def shutdown(self, sockets=None):
            # Streams end (finished or aborted, each with its final chunk) before uvicorn
            # waits for their connections; new requests meanwhile get 503, /health 503.
            await asyncio.to_thread(state.drain)
            await super().shutdown(sockets)

    limits = state.limits
    config = uvicorn.Config(create_app(state), host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.log_level in ("info", "debug"), lifespan="on",
                            timeout_graceful_shutdown=10, http=connection_class(limits),
                            timeout_keep_alive=max(1, math.ceil(limits.keep_alive_s)),
                            limit_concurrency=limits.max_connections)
    # uvicorn re-raises the signal it caught once it has shut down, with the handler that was
    # in place before it: a no-op here, so a SIGTERM ends the process with status 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        Server(config).run()
    except SystemExit as exc:  # uvicorn exits 1 when it cannot bind (its error is logged above)
        if exc.code:
            raise HeteroSDError(f"could not serve on {args.host}:{args.port}") from None
