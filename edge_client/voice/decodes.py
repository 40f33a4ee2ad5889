"""Whisper decodes of the utterance in progress, on the ASR thread (asr.AsrWorker).

Partials while the person speaks (the listener asks for them), the final one from a pause (the
listener, speculatively, at its first silent frames) or from the endpoint (endpointing, when no
speculative decode covers the speech). Each job carries its utterance's number and, for a final
one, the last voiced frame it covers; a job that went stale before the thread got to it is skipped.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .asr import AsrJob, AsrOptions, AsrResult, AsrWorker, Transcriber, close_gaps
from .state import PipelineState, Utterance
from .vad import FRAME_S


class DecodeScheduler:
    """Submits the current utterance's decodes; results go to `on_result` on the ASR thread."""

    def __init__(
        self,
        state: PipelineState,
        transcriber: Transcriber,
        opts: AsrOptions,
        on_result: Callable[[AsrResult], None],
    ) -> None:
        self.state = state
        self.opts = opts
        self._worker = AsrWorker(transcriber, on_result, self.wanted)

    @property
    def busy(self) -> bool:
        return self._worker.busy

    def partial(self, u: Utterance, t: float) -> None:
        self._worker.submit(AsrJob(self.state.utt_id, "partial", self.audio(u), t))

    def final(self, u: Utterance, upto_t: float) -> None:
        """The final decode of the speech up to the voiced frame at `upto_t` (that pause's transcript)."""
        u.spec_voiced_t = upto_t
        self._worker.submit(AsrJob(self.state.utt_id, "final", self.audio(u), upto_t))

    def audio(self, u: Utterance) -> np.ndarray:
        """The utterance for Whisper, long pauses inside it shortened (see asr.close_gaps)."""
        return close_gaps(u.audio, u.voiced, max(1, int(self.opts.max_gap_ms / 1000 / FRAME_S)))

    def wanted(self, job: AsrJob) -> bool:
        """A decode is still useful: its utterance is current and, for a final one, its pause still holds."""
        with self.state.lock:
            u = self.state.utt
            return (
                u is not None
                and job.turn == self.state.utt_id
                and (job.kind == "partial" or job.upto_t == u.spec_voiced_t)
            )

    def close(self) -> None:
        self._worker.close()
