"""Next-token selection and stop strings.

Greedy decoding (temperature 0) is a batched argmax. Sampled decoding applies temperature,
top-k and top-p to the row's logits and draws with the request's own ``torch.Generator``
seeded from the request's seed, so a seeded request produces the same tokens whatever else is
in the batch (the draw for one row never consumes another row's random numbers).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks tokens.

    Attributes:
        temperature: 0 = greedy; otherwise logits are divided by it (> 0).
        top_p: Nucleus mass in (0, 1]; 1 disables.
        top_k: Keep the k most likely tokens; 0 disables.
        seed: Seed of the request's generator; ``None`` = a random seed.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        """True for temperature 0."""
        return self.temperature <= 0.0


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed`` (random when ``None``)."""
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) if seed is not None else secrets.randbits(63))
    return g


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k and outside the top-p nucleus.

    Args:
        logits: ``[V]`` float32, already divided by the temperature.
        top_k: Keep the k largest; 0 keeps all.
        top_p: Keep the smallest set of most likely tokens whose probability mass reaches
            ``top_p`` (the most likely token is always kept); 1 keeps all.

    Returns:
        A new ``[V]`` tensor.
    """
    out = logits.clone()
    vocab = out.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(out, top_k).values[-1]
        out[out < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        # Drop a token when the mass before it already reaches top_p.
        drop = (cum - probs) >= top_p
        drop[0] = False
        out[order[drop]] = float("-inf")
    return out


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick the next token of one sequence.

    Args:
        logits: ``[V]`` float32 next-token logits.
        params: The request's sampling parameters.
        generator: The request's own generator (advanced by exactly one draw).
    """
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    greedy: Sequence[int] | None = None,
) -> list[int]:
    """Next token for every row: one batched argmax for greedy rows, own draws for the rest.

    Args:
        logits: ``[N, V]`` float32.
        params: ``N`` sampling parameters.
        generators: ``N`` generators (``None`` allowed for greedy rows).
        greedy: The rows' argmax tokens when the caller already has them on the host (it
            fetched them with other per-step figures in one device transfer).

    Raises:
        ValueError: a sampling row without a generator.
    """
    n = logits.shape[0]
    if greedy is not None:
        out = list(greedy)
    else:
        out = torch.argmax(logits, dim=-1).tolist() if n else []
    for i in range(n):
        p = params[i]
        if not p.greedy:
            g = generators[i]
            if g is None:
                raise ValueError(f"row {i} samples but has no generator")
            out[i] = sample_row(logits[i], p, g)
    return [int(t) for t in out]


class StopMatcher:
    """Streams text while watching for stop strings that may span several deltas.

    Text that could be the beginning of a stop string is held back until it is known not to
    be one. When a stop string appears, the text before it is released and the rest
    (the stop string included) is dropped.

    Args:
        stops: Stop strings (empty strings are ignored).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._pending = ""
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add decoded text; returns ``(text safe to emit now, stop string found)``."""
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        pending = self._pending + delta
        first = -1
        for s in self.stops:
            idx = pending.find(s)
            if idx >= 0 and (first < 0 or idx < first):
                first = idx
        if first >= 0:
            self.stopped = True
            self._pending = ""
            return pending[:first], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(pending)), hold, -1):
                if pending.endswith(s[:k]):
                    hold = k
                    break
        emit = pending[: len(pending) - hold]
        self._pending = pending[len(pending) - hold :]
        return emit, False

    def flush(self) -> str:
        """Release held-back text at the end of generation (no stop string followed)."""
        out, self._pending = self._pending, ""
        return out
