"""Stop strings, matched on streamed text.

A stop string can arrive split across deltas ("<|e" then "nd|>"), so text that could be the
start of one is held back until the next delta decides it; the client never sees text that a
later match would have cut. On a match the output ends just before the stop string (vLLM's
default, include_stop_str_in_output=False) and the caller aborts the sample in the engine.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop: tuple[str, ...] = tuple(stop)
        self._held = ""  # text not yet released: a suffix that is a proper prefix of a stop string

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text safe to release, the stop string that matched or None). After a match nothing
        more is fed: the sample is over."""
        buffer = self._held + text
        if not self.stop:
            self._held = ""
            return buffer, None
        match = self._earliest_match(buffer)
        if match is not None:
            index, stop = match
            self._held = ""
            return buffer[:index], stop
        held = self._partial_suffix_length(buffer)
        self._held = buffer[len(buffer) - held:] if held else ""
        return buffer[:len(buffer) - held], None

    def flush(self) -> str:
        """The held-back text, released when the sample ends without a match."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = buffer.find(stop)
            # Earliest wins; at one position the longer stop string (it covers the shorter).
            if index >= 0 and (best is None or index < best[0]
                               or (index == best[0] and len(stop) > len(best[1]))):
                best = (index, stop)
        return best

    def _partial_suffix_length(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            # Candidate starts are the occurrences of the stop string's first character within
            # the last len(stop) - 1 characters; check only those.
            start = max(len(buffer) - (len(stop) - 1), 0)
            first = stop[0]
            index = buffer.find(first, start)
            while index >= 0:
                if len(buffer) - index <= longest:
                    break
                if stop.startswith(buffer[index:]):
                    longest = len(buffer) - index
                    break
                index = buffer.find(first, index + 1)
        return longest
