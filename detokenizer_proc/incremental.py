"""Incremental (streaming) detokenization with UTF-8 safety and stop strings.

Two layers:
1. Token ids -> text, using the prefix/read offset scheme of TGI/vLLM: decode
   ids[prefix:] and ids[prefix:read] and emit the difference. Decoding with one
   chunk of left context makes leading-space handling (SentencePiece "▁",
   ByteLevel "Ġ") match a full decode, and each call only decodes the last
   chunk plus the new ids, so the cost is O(new tokens), not O(output).
2. Text -> emitted text: hold back the longest tail that could still grow into
   a stop string, so already-emitted text never has to be retracted.
"""

from __future__ import annotations

from typing import Any, Sequence

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Streams text for one request. `tokenizer` needs only
    `decode(ids, skip_special_tokens=...)` (a transformers tokenizer or a
    `tokenizers.Tokenizer`)."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids_tail: list[int] | None = None,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Only the decode window is kept: ids[prefix_offset:] of the full
        # sequence. The prompt tail seeds it as context and is never emitted
        # (it sits before the read offset).
        self._window: list[int] = list(prompt_ids_tail or [])
        self._read = len(self._window)
        self._stop: list[str] = [s for s in stop if s]
        self._pending = ""  # decoded but held back (possible stop-string start)
        self._emitted: list[str] = []
        self._done = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._emitted)

    def add(self, new_ids: list[int], finished: bool = False, matched_stop: str | None = None) -> str:
        """Append generated token ids; return the NEW text that is safe to emit now."""
        if self._done:
            return ""
        self._pending += self._decode_new(new_ids, flush=finished)
        out = self._release(finished, matched_stop)
        if out:
            self._emitted.append(out)
        return out

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _decode_new(self, new_ids: list[int], flush: bool) -> str:
        self._window.extend(new_ids)
        prefix_text = self._decode(self._window[: self._read])
        full_text = self._decode(self._window)
        # No growth (e.g. skipped special tokens) or a multi-byte char split
        # across tokens: keep the offsets so the next call re-decodes these ids
        # with more context. Genuinely invalid bytes (or a literal U+FFFD) are
        # held the same way until any clean character follows or we finish;
        # that is still correct, the window just grows meanwhile.
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_REPLACEMENT) and not flush):
            return ""
        # The window up to the old read offset becomes the next call's context.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        return full_text[len(prefix_text) :]

    def _release(self, finished: bool, matched_stop: str | None) -> str:
        pending = self._pending
        # Emitted text never ends with a stop-string prefix (it is held back),
        # so a stop string cannot straddle the emitted/pending boundary and
        # searching `pending` alone is enough. matched_stop is what the
        # generating side saw; our own stop list is a safety net.
        stops = self._stop + [matched_stop] if matched_stop else self._stop
        hits = [i for i in (pending.find(s) for s in stops) if i >= 0]
        if hits:
            self._done = True
            self._pending = ""
            return pending[: min(hits)]
        if finished:
            self._done = True
            self._pending = ""
            return pending
        hold = self._stop_prefix_len(pending)
        self._pending = pending[len(pending) - hold :]
        return pending[: len(pending) - hold]

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        if not self._stop:
            return 0
        longest = max(len(s) for s in self._stop) - 1
        for k in range(min(len(text), longest), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0
