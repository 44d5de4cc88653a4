"""Incremental detokenisation with stop strings for the server's streams."""

from __future__ import annotations


class TextStream:
    """Incremental detokenisation with stop strings (best effort).

    The whole generated sequence is decoded on every update and only the new
    characters are sent; text that could be the start of a stop string, and a
    trailing incomplete UTF-8 character, are held back until they resolve.
    """

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.token_ids: list[int] = []
        self.sent = 0  # characters of the decoded text already returned
        self.stopped = False

    def _decode(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def add(self, token_ids: list[int]) -> str:
        """New text after ``token_ids``; sets ``stopped`` when a stop string appeared (text cut before it)."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        text = self._decode()
        hits = [i for i in (text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stop) if i >= 0]
        if hits:
            cut = max(min(hits), self.sent)
            self.stopped = True
            out, self.sent = text[self.sent : cut], cut
            return out
        safe = len(text.rstrip("\ufffd"))
        for s in self.stop:  # hold back a suffix that may grow into a stop string
            for k in range(min(len(s) - 1, safe), 0, -1):
                if text[:safe].endswith(s[:k]):
                    safe -= k
                    break
        if safe <= self.sent:
            return ""
        out, self.sent = text[self.sent : safe], safe
        return out

    def flush(self) -> str:
        """The held-back rest at the end of generation."""
        if self.stopped:
            return ""
        text = self._decode()
        out, self.sent = text[self.sent :], len(text)
        return out
