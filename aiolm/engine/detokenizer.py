"""Incremental detokenization and stop strings for streamed outputs.

Three layers, each usable alone:

* :class:`IncrementalDetokenizer` turns token ids into text deltas. Byte-level
  BPE tokens can end in the middle of a UTF-8 character, so text is only
  released once it decodes cleanly (no trailing U+FFFD). It keeps a small
  window of ids (the prefix/read offsets of vLLM and TGI) so each push costs
  O(new tokens), never a re-decode of the whole output.
* :class:`StopChecker` finds stop strings in the text stream, holding back a
  suffix that could still grow into a stop string so nothing past the cut is
  ever emitted.
* :class:`TextStream` wires the two together with ``min_tokens``, for the
  output processor: ``push(ids) -> (delta, matched_stop)`` then ``finish()``.

Semantics follow vLLM v1's detokenizer and stop checker, with these choices:

* ``min_tokens``: as in vLLM, text produced while the output has at most
  ``min_tokens`` tokens is never stop-checked; a stop string may still *start*
  in that text if it *ends* after it (vLLM searches ``len(stop) - 1`` chars
  back). Stop *tokens* are the scheduler's business, not this module's.
* Several stop strings: the match that ends first in the text wins (ties: the
  one starting first, i.e. the longer), so the result does not depend on how
  tokens were chunked. vLLM takes the first in list order within one update.
* The prompt's last few tokens are decoding context (as in vLLM), so
  SentencePiece-style decoders keep the leading space of the first output
  token. For byte-level BPE (GPT-2, Llama 3, SmolLM) the decode is context
  free and the deltas concatenate to exactly
  ``tokenizer.decode(output_ids, skip_special_tokens=...)``.
* ``clean_up_tokenization_spaces`` is not applied (not incremental; HF skips
  it for BPE anyway), and ``spaces_between_special_tokens`` only reaches
  tokenizers without a Rust backend (HF fast tokenizers ignore it too).

``tokenizers.decoders.DecodeStream`` runs the same windowing in Rust but can
neither flush a trailing partial character at the end nor bound its window on
a run of invalid bytes, so it is not used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

_FFFD = "\ufffd"
# Prompt tokens kept as decoding context for the first output token.
_PROMPT_CONTEXT_TOKENS = 6
# After this many undecodable pending tokens, look for a safe place to cut the
# window so that a stream of invalid bytes cannot make each push O(n); past
# the hard cap, release even without one (never reached by UTF-8 byte tokens).
_MAX_PENDING_TOKENS = 8
_HARD_PENDING_CAP = 64

DecodeFn = Callable[[list[int]], str]
_SPECIAL_IDS: dict[int, tuple[Any, frozenset[int]]] = {}  # per tokenizer: one per model


def _rust_backend(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` behind an HF fast tokenizer (or itself)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and hasattr(tokenizer, "id_to_token") and hasattr(tokenizer, "decode"):
        backend = tokenizer  # already a tokenizers.Tokenizer
    return backend


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids the Rust decoder drops under ``skip_special_tokens`` (empty if unknown).

    Those are the added tokens flagged special, which can be more than
    ``all_special_ids`` (SmolLM2 has 17 flagged, 3 named).
    """
    backend = _rust_backend(tokenizer)
    get = getattr(backend, "get_added_tokens_decoder", None)
    if get is None:
        return frozenset()
    cached = _SPECIAL_IDS.get(id(backend))
    if cached is None or cached[0] is not backend:
        ids = frozenset(i for i, t in get().items() if getattr(t, "special", False))
        # The entry keeps the backend alive, so its id() cannot be reused.
        cached = _SPECIAL_IDS[id(backend)] = (backend, ids)
    return cached[1]


def make_decode_fn(
    tokenizer: Any, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
) -> DecodeFn:
    """Pick the cheapest exact ``ids -> str`` for this tokenizer.

    The Rust ``backend_tokenizer.decode`` is what an HF fast tokenizer's
    ``decode`` calls anyway, minus per-call Python overhead. A bare
    ``tokenizers.Tokenizer`` is accepted too; anything else falls back to
    ``tokenizer.decode``.
    """
    backend = _rust_backend(tokenizer)
    if backend is not None:
        bdecode = backend.decode

        def decode(ids: list[int]) -> str:
            return bdecode(ids, skip_special_tokens=skip_special_tokens)

        return decode

    def slow_decode(ids: list[int]) -> str:
        return tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens
        )

    return slow_decode


class IncrementalDetokenizer:
    """Token ids in, finalized text deltas out.

    ``_window`` holds the ids from the prefix offset on; ids before ``_read``
    were already turned into text (``_prefix_text`` is their decode, kept so
    that decoders which look at neighbours see the same context twice). A new
    id is decoded together with that window and the text beyond
    ``_prefix_text`` is released once it does not end in U+FFFD. Skipped
    special tokens never enter the window: the Rust decoder drops them before
    decoding anyway, so bytes on both sides still join up.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._decode = make_decode_fn(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self._drop = special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        context = [int(t) for t in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]]
        context_text = self._decode(context) if context else ""
        if context_text.endswith(_FFFD):
            # The prompt ends inside a character: output bytes must not be
            # glued onto it (decode(output_ids) would not be either).
            context, context_text = [], ""
        self._window: list[int] = context
        self._read = len(context)
        self._prefix_text = context_text
        self._parts: list[str] = []
        self._text = ""
        self._dirty = False
        self.num_tokens = 0

    @property
    def text(self) -> str:
        """All output text released so far."""
        if self._dirty:
            self._text = "".join(self._parts)
            self._parts = [self._text]
            self._dirty = False
        return self._text

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add output tokens; return the text they finalized (may be "")."""
        drop = self._drop
        ids = [int(t) for t in new_token_ids if t not in drop]
        self.num_tokens += len(new_token_ids)
        if len(ids) > 1:
            delta = self._push_run(ids)
            if delta is not None:
                return self._emit(delta)
        out = []
        for tid in ids:
            delta = self._step(tid)
            if delta:
                out.append(delta)
        return self._emit("".join(out))

    def _push_run(self, ids: list[int]) -> str | None:
        """Release several ids with two decodes instead of two per id, when they end on a
        whole character; None (nothing changed) otherwise, for the id-by-id path.

        The window is then cut to its last few ids, the same decoding context a
        prompt gives the first output token, at a cut that splits no character: the
        text ends with the tail's own decode, and neither side decodes to U+FFFD at
        the cut. A cut inside one is not only U+FFFD at the cut: SentencePiece's byte
        fallback turns a whole run of byte tokens into U+FFFD when any of it is
        invalid, so the next character's bytes would be lost too. (The two sides need
        not join to the text: a decoder that strips a leading space drops the tail's.)
        With no such cut the window is kept whole, to be cut at a later step.
        """
        w = self._window + ids
        text = self._decode(w)
        prefix = self._prefix_text
        if text.endswith(_FFFD) or not text.startswith(prefix):
            return None
        keep, keep_text = w, text
        for n in range(min(_PROMPT_CONTEXT_TOKENS, len(w) - 1), 0, -1):
            tail = self._decode(w[-n:])
            if text.endswith(tail) and not tail.startswith(_FFFD) and not self._decode(w[:-n]).endswith(_FFFD):
                keep, keep_text = w[-n:], tail
                break
        self._window, self._read, self._prefix_text = keep, len(keep), keep_text
        return text[len(prefix) :]

    def finish(self) -> str:
        """Release whatever is pending, invalid bytes (as U+FFFD) included."""
        w = self._window
        if self._read >= len(w):
            return ""
        text = self._decode(w)
        delta = text[len(self._prefix_text) :]
        self._advance(len(w))
        return self._emit(delta)

    def _emit(self, delta: str) -> str:
        if delta:
            self._parts.append(delta)
            self._dirty = True
        return delta

    def _advance(self, cut: int) -> None:
        """Make ids before ``cut`` read; the old read ids become the prefix."""
        w = self._window
        self._prefix_text = self._decode(w[self._read : cut])
        del w[: self._read]
        self._read = cut - self._read

    def _step(self, tid: int) -> str:
        w = self._window
        w.append(tid)
        text = self._decode(w)
        plen = len(self._prefix_text)
        pending = len(w) - self._read
        if not text.endswith(_FFFD):
            if len(text) > plen or pending >= _MAX_PENDING_TOKENS:
                # Release (a run of tokens that decode to nothing is
                # released too once long, to keep the window short).
                self._advance(len(w))
                return text[plen:]
            return ""
        if pending >= _MAX_PENDING_TOKENS:
            return self._forced_cut(text)
        return ""

    def _forced_cut(self, text: str) -> str:
        """Release the longest part of a long undecodable run that is final.

        A cut at ``k`` is safe when decoding both sides apart gives the same
        text as decoding them together and the right side holds some bytes:
        with lossy UTF-8 a character or invalid sequence straddling ``k``
        always decodes to more U+FFFD apart than together, and a left side
        ending in an incomplete sequence is final once a byte follows it.
        """
        w = self._window
        prefix = self._prefix_text
        for k in range(len(w) - 1, self._read, -1):
            right = self._decode(w[k:])
            if not right:
                continue  # only empty tokens to the right: left may still grow
            left = self._decode(w[:k])
            if left.startswith(prefix) and left + right == text:
                self._advance(k)
                return left[len(prefix) :]
        if len(w) - self._read < _HARD_PENDING_CAP:
            return ""
        # Still no safe cut (not byte-level UTF-8 behaviour): give up on
        # exactness rather than grow the window forever.
        self._advance(len(w))
        return text[len(prefix) :]


class PrefixMatcher:
    """Tracks the longest suffix of a growing text that is a proper prefix of ``pattern``
    (the Knuth-Morris-Pratt automaton): O(1) amortized per character fed."""

    __slots__ = ("pattern", "_fail", "state")

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        fail = [0] * len(pattern)  # fail[i]: longest proper border of pattern[:i + 1]
        k = 0
        for i in range(1, len(pattern)):
            while k and pattern[i] != pattern[k]:
                k = fail[k - 1]
            if pattern[i] == pattern[k]:
                k += 1
            fail[i] = k
        self._fail = fail
        self.state = 0

    def feed(self, text: str) -> int:
        """Advance over ``text``; returns the new state (a length < len(pattern))."""
        p, fail, k, m = self.pattern, self._fail, self.state, len(self.pattern)
        for c in text:
            while k and p[k] != c:
                k = fail[k - 1]
            if p[k] == c:
                k += 1
                if k == m:  # a whole match (in text not stop-checked): keep its longest border
                    k = fail[k - 1]
        self.state = k
        return k


class StopChecker:
    """Finds stop strings in a stream of text deltas and cuts the output.

    Only the new text plus ``max(len(stop)) - 1`` chars before it are
    searched. Without ``include_stop_str_in_output`` the longest suffix that
    is a proper prefix of some stop string is held back until resolved; with
    it nothing needs holding (the output is cut after the stop string).
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stop: list[str] = [s for s in dict.fromkeys(stop) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._keep = max((len(s) for s in self.stop), default=1) - 1
        self._matchers = [] if include_stop_str_in_output else [PrefixMatcher(s) for s in self.stop]
        self._tail = ""  # last ``_keep`` chars seen (search context)
        self._held = 0  # how many trailing chars of ``_tail`` are unemitted
        self.matched: str | None = None
        self.done = False

    def feed(self, delta: str, check: bool = True) -> tuple[str, str | None]:
        """Add text; return (text safe to emit, stop string matched or None).

        With ``check=False`` the new text is not searched for stop strings
        ending in it (``min_tokens``), but it is still held and kept as
        context for matches that end later.
        """
        if self.done:
            return "", None
        if not self.stop:
            return delta, None
        window = self._tail + delta
        new_at = len(self._tail)
        unemitted_at = new_at - self._held
        if check and delta:
            best: tuple[int, int, str] | None = None
            for s in self.stop:
                i = window.find(s, max(0, new_at - len(s) + 1))
                if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                    best = (i + len(s), i, s)
            if best is not None:
                end, start, s = best
                cut = end if self.include_stop_str_in_output else start
                self.matched = s
                self.done = True
                return window[unemitted_at : max(cut, unemitted_at)], s
        hold = 0 if self.include_stop_str_in_output else self._hold_len(delta)
        hold = min(hold, len(window) - unemitted_at)
        self._held = hold
        self._tail = window[-self._keep :] if self._keep else ""
        return window[unemitted_at : len(window) - hold], None

    def finish(self) -> str:
        """End of text without a stop string: release what was held."""
        if self.done:
            return ""
        self.done = True
        return self._tail[len(self._tail) - self._held :] if self._held else ""

    def _hold_len(self, delta: str) -> int:
        """Length of the longest suffix of the text so far that is a proper prefix of a stop.

        Each stop string's KMP automaton advances over the new text only, so the work
        per delta is linear in its length (amortized), whatever the stop strings are.
        """
        best = 0
        for m in self._matchers:
            k = m.feed(delta)
            if k > best:
                best = k
        return best


class TextStream:
    """Per-sequence text state for the output processor: detokenize, stop, hold back.

    ``push`` returns ``(delta, matched_stop)``; once a stop string matched the
    stream is finished and later pushes return ``("", None)``. At the end of a
    sequence for any other reason call ``finish()`` for the held-back text.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] = (),
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens, spaces_between_special_tokens
        )
        self.stop_checker = StopChecker(stop, include_stop_str_in_output)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.num_output_tokens = 0
        self.finished = False
        self._parts: list[str] = []

    @classmethod
    def from_params(cls, tokenizer: Any, prompt_token_ids: Sequence[int], params: Any) -> TextStream:
        """Build from a :class:`aiolm.params.SamplingParams`."""
        return cls(
            tokenizer,
            prompt_token_ids,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )

    @property
    def text(self) -> str:
        """Output text emitted so far (cut at the stop string once matched)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the sequence, if any."""
        return self.stop_checker.matched

    def push(self, new_token_ids: Sequence[int], *, stop_terminated: bool = False) -> tuple[str, str | None]:
        """Add sampled tokens; return (newly emitted text, matched stop string).

        ``stop_terminated``: the last id is a stop token (EOS or
        ``stop_token_ids``); as in vLLM its text is not added unless
        ``include_stop_str_in_output``.
        """
        if self.finished:
            return "", None
        ids = list(new_token_ids)
        before = self.num_output_tokens
        self.num_output_tokens += len(ids)
        if stop_terminated and ids and not self.include_stop_str_in_output:
            ids.pop()
        # Tokens numbered <= min_tokens are decoded but never stop-checked.
        n_unchecked = max(0, min(len(ids), self.min_tokens - before))
        out: list[str] = []
        matched = None
        if n_unchecked:
            text, _ = self.stop_checker.feed(self.detokenizer.push(ids[:n_unchecked]), check=False)
            out.append(text)
        if len(ids) > n_unchecked:
            text, matched = self.stop_checker.feed(self.detokenizer.push(ids[n_unchecked:]))
            out.append(text)
        if matched is not None:
            self.finished = True
        return self._emit("".join(out)), matched

    def finish(self) -> str:
        """The sequence ended for another reason: flush everything held.

        The flushed text is still stop-checked, so ``stop_reason`` may be set
        afterwards (only if the final bytes complete a stop string).
        """
        if self.finished:
            return ""
        self.finished = True
        check = self.num_output_tokens > self.min_tokens
        text, matched = self.stop_checker.feed(self.detokenizer.finish(), check=check)
        if matched is None:
            text += self.stop_checker.finish()
        return self._emit(text)

    def _emit(self, text: str) -> str:
        if text:
            self._parts.append(text)
        return text
