"""A request continued on this engine after another engine generated its beginning: the text at the seam.

The client sends a continuation as the original prompt followed by the tokens already generated
(``fleet.data.dispatch``); the engine generates the rest as a new request. Two things about the
text cannot be left to the engine, because it sees the carried tokens as prompt:

- the text of the carried tokens that the caller has not received yet: while streaming with stop
  strings, vLLM holds back the last characters that could begin one (and a character split across
  tokens until it is whole); the engine that died never sent them. They are the carried tokens'
  text minus what the caller has, sent first;
- a stop string that spans the seam (begins in the carried text, ends in the new): the engine checks
  only its own output. ``TextSeam`` checks the window around the seam until it is past every stop
  string's length; one found there ends the request as vLLM would (``stop``, text cut before the
  stop string, or after it with ``include_stop_str_in_output``).

What a continued request brings to the shard (``fleet.wire.Carried``: the tokens carried, the text the caller
holds of them, the oldest version that sampled them) travels in its ``fleet.wire.ServeRequest``.

Pure: no vLLM, no Ray; the shard passes the detokenized carried text in.
"""

from __future__ import annotations


class TextSeam:
    """Feed the engine's new text pieces in order; get back the text to send and, once, a seam stop."""

    def __init__(self, held: str, carried_text: str, stops: list[str] | tuple[str, ...] | None,
                 include_stop: bool = False) -> None:
        """``held``: the carried tokens' whole text; ``carried_text``: what the caller has of it."""
        self.tail = held[len(carried_text):] if held.startswith(carried_text) else ""
        self._before = carried_text + self.tail  # every carried character, the caller's and the tail
        self._stops = [s for s in (stops or ()) if s]
        self._reach = max((len(s) for s in self._stops), default=1) - 1  # characters a stop can reach back
        self._include = include_stop
        self._new = ""  # the engine's text held while the seam window is open
        self._open = True

    def feed(self, text: str, last: bool = False) -> tuple[str, str | None]:
        """The text to send for the engine's next ``text`` piece, and the stop string when one across the seam
        ends the request here (the text sent then stops where vLLM would cut it). While a stop string could
        still span the seam, new text is held back (as vLLM holds back a possible stop's beginning); the
        carried tail goes out with the first text sent. ``last``: the engine finished, send what is held."""
        if not self._open:
            return text, None
        self._new += text
        if len(self._new) < self._reach and not last:
            return "", None
        self._open = False
        window_start = max(0, len(self._before) - self._reach)
        window = self._before[window_start:] + self._new
        seam = len(self._before) - window_start  # index of the first new character in ``window``
        best: tuple[int, str] | None = None
        for s in self._stops:
            i = window.find(s, max(0, seam - len(s) + 1))
            # only a stop that begins before the seam: one wholly in the new text is the engine's own to find
            if 0 <= i < seam and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return self.tail + self._new, None
        i, s = best
        end = i + (len(s) if self._include else 0)  # where the caller's text must end, in ``window``
        tail = self.tail[:max(0, len(self.tail) - max(0, seam - end))]  # only the unsent tail can still be cut
        return tail + self._new[:max(0, end - seam)], s
