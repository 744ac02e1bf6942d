"""What a client measures beyond the engine (issue "Timing fidelity against real vLLM", item 1):
the front end and the output path around the engine's steps.

A request's first token and its last reach the client later than the engine computes them:
- **front end** (`front_s`, `front_per_prompt_token_s`): the API server receiving the request,
  tokenising the prompt, and detokenising and streaming the tokens back. It is added once, to
  every token, since streaming overlaps decoding.
- **output path** (`output_steps`): a fitted term, `output_steps` of the request's own mean
  inter-token gap (0 for a one-token output). The measured TTFT exceeds the engine's queueing
  plus prefill by about one step of the running batch, growing with the step time. Two
  mechanisms plausibly contribute:
  - vLLM V1's async scheduling (vllm/v1/engine/core.py, `step_with_batch_queue`): a request
    that arrives while step k runs is scheduled into a later step, an input-side delay of up
    to one step;
  - the engine's output processing and the API server's streaming.

  Neither is simulated step by step here. The term is an empirical, per-request stand-in
  (docs/fidelity.md).

ITL and TPOT are unchanged, since every token moves by the same amount. TTFT and E2E grow by
front end + output path.

Defaults: `front_s` = 5 ms and `output_steps` = 1, chosen on the 13 train/val vLLM v0.15.1 runs
of the public sim-to-real benchmark (docs/fidelity.md: TTFT MAPE 52.75% without them, 11.64% with
them). Those runs do not separate tokenisation's share, since their prompts are all 550-1,034
tokens, so `front_per_prompt_token_s` is 0 unless set.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvsched.errors import KvschedError


@dataclass(frozen=True)
class ClientPath:
    front_s: float = 0.005
    front_per_prompt_token_s: float = 0.0
    output_steps: float = 1.0

    def __post_init__(self) -> None:
        for name in ("front_s", "front_per_prompt_token_s", "output_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0 <= v <= 1e3):
                raise KvschedError(f"client path: {name} must be a number from 0 to 1000, got {v!r}")

    def times(self, rec) -> tuple[np.ndarray, np.ndarray]:
        """A run's (first token, finished) times as the client sees them (RunRecords `rec`)."""
        d = self.delay(rec.prompt, rec.output, rec.first_token, rec.finished)
        return rec.first_token + d, rec.finished + d

    def delay(self, prompt: np.ndarray, output: np.ndarray, first_token: np.ndarray,
              finished: np.ndarray) -> np.ndarray:
        """Seconds each request's tokens reach the client after the engine computed them."""
        with np.errstate(invalid="ignore", divide="ignore"):
            gap = np.where(output > 1, (finished - first_token) / np.maximum(output - 1, 1), 0.0)
        gap = np.where(np.isfinite(gap), gap, 0.0)
        return self.front_s + self.front_per_prompt_token_s * prompt + self.output_steps * gap


DEFAULT = ClientPath()


def parse_client_path(text: str | None) -> ClientPath | None:
    """--client-path: None (not given) the default, "off" the engine's own figures, or
    key=value pairs of ClientPath's fields (comma-separated) over the defaults."""
    if text is None:
        return DEFAULT
    if text.strip() == "off":
        return None
    fields = {f: getattr(DEFAULT, f) for f in ("front_s", "front_per_prompt_token_s", "output_steps")}
    seen: set[str] = set()
    for part in text.split(","):
        key, eq, value = part.strip().partition("=")
        if key not in fields or not eq:
            raise KvschedError(f"--client-path {text!r}: write off, or key=value of {', '.join(fields)} "
                               "(comma-separated)")
        if key in seen or "_" in value:
            raise KvschedError(f"--client-path {text!r}: {key} given twice" if key in seen else
                               f"--client-path: {key} must be a plain number, got {value!r}")
        seen.add(key)
        try:
            fields[key] = float(value)
        except ValueError:
            raise KvschedError(f"--client-path: {key} must be a number of seconds (or steps), got {value!r}") from None
    return ClientPath(**fields)
