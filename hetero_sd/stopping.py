"""When generation ends: EOS, token budget, stop strings — decided token by
token, so speculative and target-only runs stop at exactly the same token.

The stop checker is the one place a committed token enters the request's token
history (ir.work.TokenHistory): it appends every token but EOS, and reads the
output back from there."""
from __future__ import annotations

from hetero_sd.ir.work import TokenHistory


class StopChecker:
    def __init__(self, history: TokenHistory, max_new_tokens: int, eos_ids: set[int], stop: list[str],
                 tokenizer=None):
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.history, self.max_new_tokens, self.eos_ids = history, max_new_tokens, eos_ids
        self.stop, self.tokenizer = stop, tokenizer
        self.reason = ""

    @property
    def tokens(self) -> list[int]:
        """The output so far (a copy of the history's tokens after the prompt)."""
        return self.history.output

    def feed(self, token: int) -> bool:
        """Commit one token; True when generation is over."""
        if token in self.eos_ids:
            self.reason = "eos"  # the EOS token itself is not part of the output
            return True
        self.history.append(token)
        if self.stop and self._stop_hit():
            self.reason = "stop"
            return True
        if self.history.output_len >= self.max_new_tokens:
            self.reason = "length"
            return True
        return False

    def _stop_hit(self) -> bool:
        # Decode a tail only: a stop string can end in the newest token alone.
        tail = self.tokenizer.decode(self.history.tail(32), skip_special_tokens=False)
        return any(s in tail for s in self.stop)

    def text(self) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if self.reason == "stop":
            cut = min((text.find(s) for s in self.stop if s in text), default=-1)
            if cut >= 0:
                text = text[:cut]
        return text


class TextStream:
    """Streamed text: deltas that add up to exactly StopChecker.text(). A delta
    never ends inside a UTF-8 character, inside what may yet become a stop
    string, or in text the newest token could still change when decoded with
    the next one.

    Incremental, as vLLM detokenizes: the settled text grows by decoding a
    window that starts where the previous delta's tokens began (so a tokenizer
    that trims a first token's leading space trims it on both sides) and
    keeping what the window adds beyond its first part. A token costs the
    decode of a few tokens, not of the whole output."""

    def __init__(self, stopper: StopChecker):
        self.stopper, self.sent = stopper, 0
        self._prefix = self._read = 0  # output offsets: the window's start, the end of what is settled
        self._settled = ""  # the text of output[:_read]

    def _settle(self) -> str:
        history = self.stopper.history
        end = history.output_len - 1  # the newest token is held back
        if end > self._read:
            decode = self.stopper.tokenizer.decode
            window_ids = history.output_since(self._prefix)[:end - self._prefix]
            head = decode(window_ids[:self._read - self._prefix], skip_special_tokens=True)
            window = decode(window_ids, skip_special_tokens=True)
            # A window that ends inside a character waits for the bytes that complete it.
            if not window.endswith("\ufffd") and window.startswith(head):
                self._settled += window[len(head):]
                self._prefix, self._read = self._read, end
        return self._settled

    def delta(self, final: bool = False) -> str:
        s = self.stopper
        if s.tokenizer is None:
            return ""
        if final:
            text = s.text()
        else:
            text = self._settle()
            text = text[:len(text) - _stop_prefix(text, s.stop)]
        out = text[self.sent:] if len(text) > self.sent else ""
        self.sent += len(out)
        return out


def _stop_prefix(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that begins some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop), len(text)), best, -1):
            if stop.startswith(text[-n:]):
                best = n
                break
    return best
