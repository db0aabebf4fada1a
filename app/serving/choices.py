"""Engine outputs as choice deltas: one choice's incremental detokenizer, stop strings,
token count and finish reason (torch-free)."""

from __future__ import annotations

from app.errors import EngineError
from app.openai.formatting import ChoiceDelta
from engine.core.protocol import CompletionOutput, FinishReason
from engine.tokenizer import IncrementalDetokenizer


class Choice:
    """One choice's progress: detokenizer, stop strings, token count, finish reason.

    trim_stop_token: the EOS or stop_token_ids token that ends the choice adds no text
    (SGLang's default once special tokens are kept, skip_special_tokens=false; no_stop_trim
    keeps it). With special tokens skipped the text is as it always was.
    """

    def __init__(
        self, index: int, detokenizer: IncrementalDetokenizer, trim_stop_token: bool = False
    ) -> None:
        self.index = index
        self.detokenizer = detokenizer
        self.trim_stop_token = trim_stop_token
        self.finish_reason: str | None = None

    def advance(self, output: CompletionOutput) -> ChoiceDelta:
        delta = ChoiceDelta(self.index)
        logprobs = output.new_logprobs or []
        for position, token_id in enumerate(output.new_token_ids):
            delta.text_offsets.append(self.detokenizer.num_decoded_chars)
            if not self._is_trimmed_stop_token(output, position):
                delta.text += self.detokenizer.feed_token(token_id)
            delta.token_ids.append(token_id)
            if position < len(logprobs):
                delta.logprobs.append(logprobs[position])
            if self.detokenizer.is_stopped:  # later tokens lie beyond the cut
                self.finish_reason = delta.finish_reason = "stop"
                delta.stop_string = self.detokenizer.stop_string
                return delta
        if output.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            delta.text += self.detokenizer.finish()
            self.finish_reason = delta.finish_reason = output.finish_reason.value
        elif output.finish_reason is not None:
            raise EngineError(f"the engine ended choice {self.index} ({output.finish_reason})")
        return delta

    def _is_trimmed_stop_token(self, output: CompletionOutput, position: int) -> bool:
        return (
            self.trim_stop_token
            and output.stop_token_id is not None
            and position == len(output.new_token_ids) - 1
            and output.new_token_ids[position] == output.stop_token_id
        )
