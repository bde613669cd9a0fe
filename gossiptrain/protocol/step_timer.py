"""The time one local step takes, as the safe points see it, without flow control's waits.

Policies that weigh the link against computation read it: ``auto``
compression (``protocol.auto_compression``) and the number of pairwise
exchanges in flight (``PairwiseAveraging.concurrency``).
"""

from __future__ import annotations

#: Weight of a new measurement in the smoothed step time.
STEP_SMOOTHING = 0.1


class StepTimer:
    """Seconds of one local step, smoothed: between safe points, less the seconds flow control waited."""

    def __init__(self) -> None:
        self.step_time: float | None = None
        self._last: tuple[int, float, float] | None = None  # (step, now, seconds waited so far)

    def at_step(self, step: int, now: float, waited_s: float) -> None:
        """A safe point after local step ``step``; ``waited_s``: seconds flow control waited so far, in all."""
        if self._last is not None:
            steps = step - self._last[0]
            seconds = (now - self._last[1]) - (waited_s - self._last[2])
            if steps > 0 and seconds >= 0:
                per = seconds / steps
                self.step_time = per if self.step_time is None else self.step_time + STEP_SMOOTHING * (per - self.step_time)
        self._last = (step, now, waited_s)
