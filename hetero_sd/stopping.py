"""When generation ends: EOS, token budget, stop strings — decided token by
token, so speculative and target-only runs stop at exactly the same token."""
from __future__ import annotations


class StopChecker:
    def __init__(self, max_new_tokens: int, eos_ids: set[int], stop: list[str], tokenizer=None):
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.max_new_tokens, self.eos_ids, self.stop, self.tokenizer = max_new_tokens, eos_ids, stop, tokenizer
        self.tokens: list[int] = []
        self.reason = ""

    def feed(self, token: int) -> bool:
        """Record one committed token; True when generation is over."""
        if token in self.eos_ids:
            self.reason = "eos"  # the EOS token itself is not part of the output
            return True
        self.tokens.append(token)
        if self.stop and self._stop_hit():
            self.reason = "stop"
            return True
        if len(self.tokens) >= self.max_new_tokens:
            self.reason = "length"
            return True
        return False

    def _stop_hit(self) -> bool:
        # Decode a tail only: a stop string can end in the newest token alone.
        tail = self.tokenizer.decode(self.tokens[-32:], skip_special_tokens=False)
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
