"""What the reporting rank shows while training: a progress bar on a terminal, plain lines
otherwise (a log file, CI), so piped output stays the same as it always was."""

from __future__ import annotations

import sys
from contextlib import ExitStack

from bundle import log


class Console:
    """``advance(done)`` after every step, ``window(done, record)`` when a loss window closes,
    ``line(text)`` for anything else, ``close()`` at the end.

    On a terminal a tqdm bar shows step, epoch, loss, samples/s and ETA, and log lines are
    printed above it; elsewhere each window is one log line.
    """

    def __init__(
        self, *, total: int, start: int, steps_per_epoch: int, enabled: bool, stream=None
    ) -> None:
        self.total, self.spe = total, max(1, steps_per_epoch)
        self.bar = None
        self._stack = ExitStack()
        stream = stream or sys.stderr
        if enabled and stream.isatty():
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(
                total=total, initial=start, unit="step", dynamic_ncols=True, file=stream
            )
            self._stack.enter_context(logging_redirect_tqdm([log.get()]))
        self.enabled = enabled

    def advance(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.bar.n)

    def window(self, done: int, record: dict) -> None:
        if not self.enabled:
            return
        epoch = (done - 1) // self.spe + 1
        lr = f"  lr {record['lr']:.4g}" if record.get("lr") is not None else ""
        if self.bar is not None:
            self.bar.set_postfix_str(
                f"epoch {epoch}  loss {record['loss']:.4f}  {record['samples_per_s']:.1f} samples/s{lr}"
            )
        else:
            log.get().info(
                f"step {done}/{self.total}  loss {record['loss']:.4f}  "
                f"{record['samples_per_s']:.1f} samples/s{lr}"
            )

    def line(self, text: str) -> None:
        if self.enabled:
            log.get().info(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self._stack.close()
