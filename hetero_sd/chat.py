"""`hetero-sd chat`: a multi-turn conversation with one loaded engine.

Each turn goes through the tokenizer's chat template; the reply streams as
it is committed. The conversation's KV is kept between turns: the next turn
copies the positions it shares with the last (runner.copy_prefix, the
serving prefix cache's exact copy) and prefills only what is new, where the
target can copy KV exactly (onnxruntime); elsewhere each turn prefills the
whole conversation, and /stats says so. Ctrl-C stops the reply, not the
session: what was shown stays in the conversation."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

from hetero_sd.serve.prefix import PrefixCache

HELP = ("commands: /reset (forget the conversation), /system TEXT (set the system prompt and reset), "
        "/stats (the last turn's figures), /exit (or Ctrl-D); Ctrl-C stops a reply")


@dataclass
class Turn:
    """The last reply's figures, for /stats."""
    prompt_tokens: int = 0
    reused_tokens: int = 0
    new_tokens: int = 0
    summary: str = ""
    trimmed: int = 0  # earlier messages dropped to fit the context


@dataclass
class ChatSession:
    engine: object
    system: str | None = None
    max_new_tokens: int | None = None
    messages: list[dict] = field(default_factory=list)
    last: Turn = field(default_factory=Turn)

    def __post_init__(self):
        target = self.engine.target_runner
        # One kept sequence: the conversation so far (its KV), where copies are exact.
        self.prefix = PrefixCache(target, max_entries=1, min_tokens=1) if target.can_copy_prefix else None

    def reset(self, system: str | None = None) -> None:
        self.messages = []
        if system is not None:
            self.system = system or None
        if self.prefix is not None:
            self.prefix.clear()

    def close(self) -> None:
        if self.prefix is not None:
            self.prefix.clear()

    def _conversation(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages

    def _fitted(self) -> tuple[list[int], int]:
        """The conversation's ids, the oldest exchanges dropped until the prompt and a
        reply's budget fit the target's context; and how many messages were dropped."""
        engine, dropped = self.engine, 0
        budget = self.max_new_tokens or engine.max_new_tokens
        room = engine.target_runner.max_context
        while True:
            ids = engine.encode_chat(self._conversation())
            if len(ids) + min(budget, room // 2) <= room or len(self.messages) <= 1:
                return ids, dropped
            drop = 2 if len(self.messages) > 2 else 1  # a user turn and its reply
            del self.messages[:drop]
            dropped += drop

    def reply(self, text: str, write) -> str:
        """Answer `text`, writing the reply's text to `write` as it is committed; the
        reply (partial if interrupted) joins the conversation."""
        self.messages.append({"role": "user", "content": text})
        ids, dropped = self._fitted()
        shown: list[str] = []

        def emit(delta: str) -> None:
            if delta:
                shown.append(delta)
                write(delta)

        try:
            result = self.engine.generate_ids(ids, self.max_new_tokens, on_text=emit, prefix=self.prefix)
        except KeyboardInterrupt:
            self.messages.append({"role": "assistant", "content": "".join(shown)})
            self.last = Turn(len(ids), 0, 0, "interrupted", dropped)
            raise
        self.messages.append({"role": "assistant", "content": result.text})
        stats = result.stats
        self.last = Turn(len(ids), stats.cached_tokens, len(ids) - stats.cached_tokens, stats.summary(), dropped)
        return result.text

    def stats(self) -> str:
        t = self.last
        where = "" if self.prefix is not None else \
            " (this target cannot copy KV exactly, so every turn prefills the whole conversation)"
        return (f"last turn: prompt {t.prompt_tokens} tokens, {t.reused_tokens} reused from the previous turn, "
                f"{t.new_tokens} prefilled{where}; {len(self.messages)} messages kept"
                + (f", {t.trimmed} dropped to fit the context" if t.trimmed else "") + f"\n{t.summary}")


def add_parser(sub) -> None:
    chat = sub.add_parser("chat", help="an interactive multi-turn chat with one loaded model",
                          description="Chat: each turn through the model's chat template, the reply streamed; "
                                      "earlier turns' KV is reused where the target can copy it exactly. " + HELP)
    chat.add_argument("--config", help="YAML config (default: the packaged configs/cpu.yaml)")
    chat.add_argument("--system", help="a system prompt")
    chat.add_argument("--max-new-tokens", type=int, help="override generation.max_new_tokens (per reply)")
    chat.add_argument("--target-only", action="store_true", help="no speculation: the drafter is not loaded")
    chat.add_argument("--progress", action="store_true", help="show load progress even when not a TTY")
    from hetero_sd.flags import add_model_flags

    add_model_flags(chat)
    chat.set_defaults(func=_chat)


def _chat(args) -> int:
    from hetero_sd import flags
    from hetero_sd.engine import Engine

    cfg = flags.load(args, {"generation.max_new_tokens": args.max_new_tokens})
    engine = Engine.from_config(cfg, progress=sys.stderr.isatty() or args.progress, target_only=args.target_only)
    if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
        from hetero_sd.errors import HeteroSDError

        raise HeteroSDError(f"{cfg.target.model}: the model's tokenizer has no chat template; "
                            "use hetero-sd generate --no-chat-template")
    try:
        return run(engine, str(cfg.target.model), args.system)
    finally:
        engine.close()


def run(engine, title: str, system: str | None = None, max_new_tokens: int | None = None,
        read=input, out=sys.stdout, err=sys.stderr) -> int:
    """The interactive loop: a line is a user turn or a /command."""
    session = ChatSession(engine, system, max_new_tokens)

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    print(f"chat with {title}; {HELP}", file=err)
    try:
        while True:
            try:
                line = read("> ")
            except EOFError:
                print(file=err)
                return 0
            except KeyboardInterrupt:
                print("\n(/exit or Ctrl-D ends the session)", file=err)
                continue
            if not line.strip():
                continue
            if line.startswith("/"):
                if _command(session, line.strip(), err):
                    return 0
                continue
            try:
                session.reply(line, write)
                write("\n")
            except KeyboardInterrupt:
                write("\n")
                print("(reply stopped)", file=err)
            if session.last.trimmed:
                print(f"(the conversation outgrew the context: the {session.last.trimmed} oldest messages "
                      "were dropped)", file=err)
    finally:
        session.close()


def _command(session: ChatSession, line: str, err) -> bool:
    """Run a /command; True when the session ends."""
    name, _, arg = line.partition(" ")
    if name in ("/exit", "/quit"):
        return True
    if name == "/reset":
        session.reset()
        print("(conversation reset)", file=err)
    elif name == "/system":
        session.reset(arg.strip())
        print(f"(system prompt {'set' if arg.strip() else 'cleared'}; conversation reset)", file=err)
    elif name == "/stats":
        print(session.stats(), file=err)
    else:
        print(f"unknown command {name!r}; {HELP}", file=err)
    return False
