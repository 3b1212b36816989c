"""Streaming text from token ids: incremental detokenization and stop strings, linear in the output.

``TextStream.push(tokens)`` returns the new text that is safe to send and whether a stop string
ended the generation; ``finish()`` returns what was held back. Per token the tokenizer decodes
a window of a few tokens (the sliding prefix/read offsets vLLM and TGI use), and stop strings
are searched only in the text not yet sent plus the longest stop's length minus one.
"""

from __future__ import annotations

from laplace_jax.data.tokenizer import Tokenizer

CONTEXT_TOKENS = 5  # prompt tokens decoded before the output, for tokenizers whose decode is context-dependent
MAX_WINDOW = 16  # tokens after which a run of undecodable text (e.g. invalid UTF-8) is settled anyway
CHAR_TOKENS = 4  # at most this many tokens make up one character (UTF-8: 4 bytes)


class IncrementalDecoder:
    """Token ids -> text deltas; the tokenizer sees a window of at most ~MAX_WINDOW + CONTEXT_TOKENS
    ids per call, so the work is linear in the output.

    ``ids[:read]`` is context (its text was sent, or is the prompt's); ``sent`` counts characters
    sent beyond it. Text is sent up to any trailing U+FFFD run (a character still incomplete);
    the window restarts where everything decoded so far was sent.
    """

    def __init__(self, tokenizer: Tokenizer, context_ids: list[int] = ()):
        self.tok = tokenizer
        self.ids = list(context_ids)[-CONTEXT_TOKENS:]
        if tokenizer.decode(self.ids).endswith("\ufffd"):
            self.ids = []  # a prompt ending mid-character would merge with the output's first bytes
        self.read = len(self.ids)
        self.sent = 0

    def push(self, tokens: list[int], final: bool = False) -> str:
        self.ids.extend(tokens)
        base = len(self.tok.decode(self.ids[: self.read]))
        text = self.tok.decode(self.ids)
        end = len(text) if final else len(text.rstrip("\ufffd"))
        cut, cut_len = (len(self.ids), len(text)) if end == len(text) else self._forced_cut(text)
        end = max(end, cut_len)
        delta = text[base + self.sent : end]
        self.sent = max(self.sent, end - base)
        if cut is not None:  # restart the window at ``cut``: what came before is settled and sent
            self.sent = base + self.sent - cut_len
            del self.ids[: self.read]
            self.read = cut - self.read
        return delta

    def _forced_cut(self, text: str) -> tuple[int | None, int]:
        """Where a long undecodable run may be settled: the latest cut, at least CHAR_TOKENS tokens
        back (so no character can still complete across it), whose text is a prefix of ``text``."""
        if len(self.ids) - self.read <= MAX_WINDOW:
            return None, 0
        for c in range(len(self.ids) - CHAR_TOKENS, self.read, -1):
            head = self.tok.decode(self.ids[:c])
            if text.startswith(head):
                return c, len(head)
        return None, 0

    def flush(self) -> str:
        return self.push([], final=True)


class StopMatcher:
    """Finds the earliest stop string in streamed text, holding back only a tail that could begin one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.matched: str | None = None  # the stop string that was hit

    def feed(self, delta: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string was hit: then nothing after it is sent)."""
        buf = self.pending + delta
        found = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if found:
            hit, self.matched = min(found, key=lambda f: (f[0], -len(f[1])))
            self.pending = ""
            return buf[:hit], True
        keep = next((k for k in range(min(self.hold, len(buf)), 0, -1) if self._could_start(buf[-k:])), 0)
        self.pending = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def _could_start(self, tail: str) -> bool:
        return any(s.startswith(tail) for s in self.stops)

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class TextStream:
    """Incremental decoding followed by stop-string matching."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str], context_ids: list[int] = ()):
        self.decoder = IncrementalDecoder(tokenizer, context_ids)
        self.matcher = StopMatcher(stops)

    def push(self, tokens: list[int]) -> tuple[str, bool]:
        return self.matcher.feed(self.decoder.push(tokens))

    def finish(self) -> tuple[str, bool]:
        """Everything still held back, at the end of the generation."""
        text, hit = self.matcher.feed(self.decoder.flush())
        return (text, True) if hit else (text + self.matcher.flush(), False)
