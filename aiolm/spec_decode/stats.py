"""Acceptance counters: engine-wide totals for metrics, and a per-request window
that turns drafting off while it does not pay."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Running totals since start, named like vLLM's spec-decode counters.

    ``num_drafts`` counts verifications (one request, one step, at least one draft);
    ``accepted_per_position[i]`` counts drafts at index i that were accepted and
    ``drafted_per_position[i]`` those proposed there, so position i's acceptance
    rate is their ratio (a draft is only accepted if all before it were).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        grow = drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(drafted):
            self.drafted_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification: the accepted drafts plus the one sampled after them."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def summary(self) -> str:
        per_pos = ", ".join(f"{a / d:.2f}" for a, d in zip(self.accepted_per_position, self.drafted_per_position))
        return (
            f"speculative decoding: {self.num_drafts} verifications, {self.num_draft_tokens} drafted, "
            f"{self.num_accepted_tokens} accepted ({100 * self.acceptance_rate:.1f}%), "
            f"mean acceptance length {self.mean_acceptance_length:.2f}, per position [{per_pos}]"
        )


class AcceptanceWindow:
    """One request's last ``window`` verifications; pauses drafting when their rate is low,
    and sizes the next draft by the last outcome.

    A pause lasts ``backoff`` decode steps and doubles (to 16x) each time the rate is
    still low after it, so a request whose text never repeats is re-tried rarely; a
    good window resets it. Pausing per request keeps a copying request fast while a
    free-writing one in the same batch stops paying for rejected drafts.

    Draft length: each draft position costs a token of forward pass whether or not it
    is accepted, so after a verification that accepted ``a`` drafts the next draft
    has at most ``a + 1`` (up to ``max_len``): a copied run keeps the full length,
    a request whose drafts fail early drafts one token at a time.
    """

    __slots__ = ("_hist", "_drafted", "_accepted", "_min_rate", "_base", "_backoff", "_pause", "_max_len", "draft_len")

    def __init__(self, window: int, min_rate: float, backoff: int, max_len: int = 1 << 30) -> None:
        self._hist: deque[tuple[int, int]] = deque(maxlen=window)
        self._drafted = self._accepted = 0
        self._min_rate = min_rate
        self._base = self._backoff = backoff
        self._pause = 0
        self._max_len = max_len
        self.draft_len = max_len  # most drafts worth proposing next

    def allow(self) -> bool:
        """Called once per decode step: False while paused (and counts the pause down)."""
        if self._pause:
            self._pause -= 1
            return False
        return True

    def record(self, drafted: int, accepted: int) -> None:
        self.draft_len = min(self._max_len, accepted + 1)
        hist = self._hist
        if len(hist) == hist.maxlen:
            d, a = hist[0]
            self._drafted -= d
            self._accepted -= a
        hist.append((drafted, accepted))
        self._drafted += drafted
        self._accepted += accepted
        if len(hist) < hist.maxlen:  # type: ignore[operator]
            return
        if self._accepted < self._min_rate * self._drafted:
            self._pause = self._backoff
            self._backoff = min(self._backoff * 2, 16 * self._base)
            hist.clear()
            self._drafted = self._accepted = 0
        else:
            self._backoff = self._base
