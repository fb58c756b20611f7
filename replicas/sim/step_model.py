"""Engine step time: ``t = a + b·prefill_tokens + c·decode_seqs + d·context_tokens``.

The constants are fitted from real runs and stored with their source under
``replicas/sim/profiles/`` (JSON: ``a_s``, ``b_s_per_token``, ``c_s_per_seq``,
``d_s_per_context_token``, and optionally the measured prefill points, which are used by
piecewise-linear interpolation because prefill grows faster than linearly past ~8k tokens
(docs/reference.md 6.1)).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path

PROFILE_DIR = Path(__file__).with_name("profiles")


@dataclass
class StepTimeModel:
    """Step time of one engine (seconds).

    Attributes:
        a_s: fixed cost per step.
        b_s_per_token: per prefill token.
        c_s_per_seq: per decoding sequence.
        d_s_per_context_token: per token of context attended by the step's sequences.
        prefill_points: optional measured ``[(tokens, seconds)]`` of single prefills; when
            present, the prefill part uses them (interpolated, extrapolated linearly).
        name / source: where the constants come from.
    """

    a_s: float
    b_s_per_token: float
    c_s_per_seq: float
    d_s_per_context_token: float = 0.0
    prefill_points: list[tuple[int, float]] = field(default_factory=list)
    name: str = ""
    source: str = ""

    def prefill_s(self, tokens: int) -> float:
        """Time of a prefill of ``tokens`` tokens beyond the fixed step cost."""
        if tokens <= 0:
            return 0.0
        pts = self.prefill_points
        if len(pts) < 2:
            return self.b_s_per_token * tokens
        xs = [p[0] for p in pts]
        i = bisect.bisect_left(xs, tokens)
        if i == 0:
            (x0, y0), (x1, y1) = pts[0], pts[1]
        elif i >= len(pts):
            (x0, y0), (x1, y1) = pts[-2], pts[-1]
        else:
            (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        slope = (y1 - y0) / (x1 - x0)
        return max(y0 + slope * (tokens - x0) - self.a_s, self.b_s_per_token * tokens * 0.5)

    def step_s(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        """Duration of one step."""
        return (self.a_s + self.prefill_s(prefill_tokens) + self.c_s_per_seq * decode_seqs
                + self.d_s_per_context_token * context_tokens)

    @classmethod
    def load(cls, name_or_path: str) -> "StepTimeModel":
        """A stored profile by name (``replicas/sim/profiles/<name>.json``) or path.

        Raises:
            FileNotFoundError: no such profile.
        """
        path = Path(name_or_path)
        if not path.exists():
            path = PROFILE_DIR / f"{name_or_path}.json"
        data = json.loads(path.read_text())
        fit = data["fit"]
        return cls(a_s=fit["a_s"], b_s_per_token=fit["b_s_per_token"],
                   c_s_per_seq=fit["c_s_per_seq"],
                   d_s_per_context_token=fit.get("d_s_per_context_token", 0.0),
                   prefill_points=[tuple(p) for p in data.get("prefill_points", [])],
                   name=data.get("name", path.stem), source=data.get("source", ""))

    @classmethod
    def parse(cls, spec: str) -> "StepTimeModel":
        """``"a,b,c,d"`` (seconds) or a profile name/path."""
        parts = spec.split(",")
        if len(parts) == 4:
            a, b, c, d = (float(x) for x in parts)
            return cls(a, b, c, d, name="inline", source="command line")
        return cls.load(spec)
