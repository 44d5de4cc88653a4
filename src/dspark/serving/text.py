"""Incremental detokenisation with stop strings for the server's streams.

Each generated token is decoded once: with the `tokenizers` ``DecodeStream`` of a fast tokenizer, else
(slow tokenizers, or ones that clean up spaces after decoding) by decoding a window of the last few
tokens, as vLLM's ``detokenize_incrementally`` does. The whole output is never decoded again, so a
step costs the same at token 10 and at token 10,000.
"""

from __future__ import annotations

from bisect import bisect_left

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

_REPLACEMENT = "\ufffd"  # what a decoder shows for an incomplete UTF-8 character


class IncrementalDecoder:
    """Token ids in, new text out; an incomplete UTF-8 character at the end is held until it completes."""

    WINDOW = 5  # already-returned tokens decoded again as context (spaces of SentencePiece-style decoders)

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.read = 0  # tokens whose text has been returned
        backend = getattr(tokenizer, "backend_tokenizer", None)
        fast = DecodeStream is not None and backend is not None
        if fast and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._backend, self._stream = backend, DecodeStream(skip_special_tokens=skip_special_tokens)
        else:
            self._backend, self._stream = None, None

    def step(self, token_id: int) -> str:
        """The text that ``token_id`` completes ("" while a character is incomplete)."""
        self.ids.append(int(token_id))
        if self._stream is not None:
            chunk = self._stream.step(self._backend, int(token_id))
        else:
            chunk = self._window(final=False)
        if chunk is None:
            return ""
        self.read = len(self.ids)
        return chunk

    def flush(self) -> str:
        """The held-back tail at the end of generation (an incomplete character decodes as U+FFFD)."""
        if self.read == len(self.ids):
            return ""
        chunk = self._window(final=True)
        self.read = len(self.ids)
        return chunk or ""

    def _window(self, final: bool) -> str | None:
        start = max(self.read - self.WINDOW, 0)
        prefix = self._decode(self.ids[start : self.read])
        text = self._decode(self.ids[start:])
        if not final and (len(text) <= len(prefix) or text.endswith(_REPLACEMENT)):
            return None
        return text[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def decode_prefix(self, count: int) -> str:
        """The whole characters of the first ``count`` tokens (one full decode: for rare use)."""
        return self._decode(self.ids[:count]).rstrip(_REPLACEMENT)


class StopMatcher:
    """Where one stop string first appears in a growing text (Knuth-Morris-Pratt).

    ``partial`` is the length of the longest end of the text read so far that is a start of the stop
    string: the characters a stream must hold back. Each character costs amortised O(1), the table
    O(len(stop)) once, so a long stop string costs linear time, never len(text) x len(stop).
    """

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.partial = 0
        fail = [0] * len(stop)  # fail[i]: longest proper border of stop[: i + 1]
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            fail[i] = k
        self._fail = fail

    def feed(self, text: str, start: int) -> int:
        """Read ``text[start:]``; the index where the stop string begins if it is now complete, else -1."""
        stop, fail, k = self.stop, self._fail, self.partial
        for i in range(start, len(text)):
            c = text[i]
            while k and c != stop[k]:
                k = fail[k - 1]
            if c == stop[k]:
                k += 1
            if k == len(stop):
                self.partial = k
                return i + 1 - k
        self.partial = k
        return -1


class TextStream:
    """The text of one generation, cut at the first stop string.

    ``add`` returns the new text that is safe to send: text that could be the start of a stop string is
    held back until it resolves. When a stop string appears, ``stopped`` is set and the text ends before
    it (``include_stop``: after it). ``num_tokens`` counts the tokens behind the returned text, so usage
    ends at the stop string even when a speculative step committed tokens past it.
    """

    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True,
                 include_stop: bool = False) -> None:
        self.decoder = IncrementalDecoder(tokenizer, skip_special_tokens)
        self.stop = [s for s in stop if s]
        self._matchers = [StopMatcher(s) for s in self.stop]
        self.include_stop = include_stop
        self.text = ""  # decoded so far (append-only)
        self.ends: list[int] = []  # len(self.text) after each token
        self.sent = 0  # characters of the text already returned
        self.stopped = False
        self._stop_tokens = 0  # num_tokens once stopped

    @property
    def token_ids(self) -> list[int]:
        """Every token received, those past a stop string included."""
        return self.decoder.ids

    @property
    def num_tokens(self) -> int:
        """Tokens behind the returned text: all, or when stopped the shortest prefix that covers the text."""
        return self._stop_tokens if self.stopped else len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        """The ``num_tokens`` first token ids: those a client is told about."""
        return self.token_ids[: self.num_tokens]

    def add(self, token_ids: list[int]) -> str:
        """New text after ``token_ids``; sets ``stopped`` when a stop string appeared."""
        if self.stopped:
            return ""
        start = len(self.text)
        for t in token_ids:
            self.text += self.decoder.step(t)
            self.ends.append(len(self.text))
        text = self.text
        # each matcher reads only the new characters: linear in the text and the stop strings together
        hits = [(i, m.stop) for i, m in ((m.feed(text, start), m) for m in self._matchers) if i >= 0]
        if hits:
            where, stop = min(hits, key=lambda h: h[0])
            cut = max(where + len(stop) if self.include_stop else where, self.sent)
            self.stopped = True
            out, self.sent = text[self.sent : cut], cut
            self._stop_tokens = self._covering(cut)
            return out
        hold = max((m.partial for m in self._matchers), default=0)  # the end that may grow into a stop string
        safe = len(text) - hold
        if safe <= self.sent:
            return ""
        out, self.sent = text[self.sent : safe], safe
        return out

    def _covering(self, chars: int) -> int:
        """The fewest leading tokens whose text holds the first ``chars`` characters."""
        if chars == 0:
            return 0
        n = bisect_left(self.ends, chars) + 1
        # a character split over tokens counts for the token that completes it, so the text before it
        # may end in an earlier token: step back while the shorter prefix still holds the characters
        while n > 1 and len(self.decoder.decode_prefix(n - 1)) >= chars:
            n -= 1
        return n

    def flush(self) -> str:
        """The held-back rest at the end of generation."""
        if self.stopped:
            return ""
        self.text += self.decoder.flush()
        out, self.sent = self.text[self.sent :], len(self.text)
        return out
