"""A verifiable task generated on the fly: fixed-width addition.

A prompt is ``"ab+cd="`` with both operands written with ``digits`` digits
(zero padded), so every prompt has the same length ``P = 2 * digits + 2``. The
answer is the sum in decimal without leading zeros followed by ``EOS``: at most
``digits + 1`` digits, so the decoder gets ``max_new = digits + 2`` tokens.

Vocabulary: ids 0..9 are the digits, then ``+``, ``=``, ``EOS``, ``PAD``.

Hierarchical reward of a generated answer ``y`` (the tokens up to and
including the first ``EOS``; ``|y|`` counts that ``EOS``)::

    r(y) = 0                                  y is not well formed
         = format_credit                      well formed, wrong value
         = 1 + brevity * (max_new - |y|) / max_new     correct value

Well formed means 1 to ``digits + 1`` digit tokens, then ``EOS``. Correct means
the digits' value is ``a + b``; leading zeros are allowed but cost the brevity
bonus (which only correct answers get, so a short wrong answer never beats a
long wrong one).

The operand pairs are split once, with a seed independent of the run's, into a
training pool and a held-out set that training never samples.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

PLUS, EQUALS, EOS, PAD = 10, 11, 12, 13
VOCAB = 14
_SPLIT_SEED = 20240611
MAX_DIGITS = 3


@dataclasses.dataclass(frozen=True)
class AdditionTask:
    digits: int = 2
    held_out: int = 500
    format_credit: float = 0.2
    brevity: float = 0.1

    @property
    def prompt_len(self) -> int:
        return 2 * self.digits + 2

    @property
    def max_new(self) -> int:
        return self.digits + 2

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.max_new

    def __post_init__(self):
        if isinstance(self.digits, bool) or self.digits not in range(1, MAX_DIGITS + 1):
            raise ValueError(
                f"digits: expected 1..{MAX_DIGITS} (the task enumerates all "
                f"(10^digits)^2 operand pairs), got {self.digits!r}"
            )
        n = 10**self.digits
        if not 0 < self.held_out < n * n // 2:
            raise ValueError(
                f"held_out: expected 1..{n * n // 2 - 1} for digits={self.digits} "
                f"(less than half of the {n * n} operand pairs), got "
                f"{self.held_out}"
            )

    def _pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """All operand pairs as flat indices, split into (train pool, held-out)."""
        n = 10**self.digits
        order = np.random.default_rng(_SPLIT_SEED).permutation(n * n)
        return np.sort(order[self.held_out :]), np.sort(order[: self.held_out])

    def encode(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Prompts [B, P] int32 and sums [B] int32 for flat pair indices."""
        n = 10**self.digits
        a, b = index // n, index % n
        powers = 10 ** np.arange(self.digits - 1, -1, -1)
        da = (a[:, None] // powers) % 10
        db = (b[:, None] // powers) % 10
        col = lambda v: np.full((len(index), 1), v)
        prompts = np.concatenate([da, col(PLUS), db, col(EQUALS)], axis=1)
        return prompts.astype(np.int32), (a + b).astype(np.int32)

    def answer_tokens(self, sums: np.ndarray) -> np.ndarray:
        """The correct answers [B, max_new]: digits of the sum, EOS, then PAD."""
        sums = np.asarray(sums, np.int64)
        length = 1 + sum((sums >= 10**k).astype(np.int64) for k in range(1, self.digits + 1))
        pos = np.arange(self.max_new)[None, :]
        place = np.maximum(length[:, None] - 1 - pos, 0)
        digits = (sums[:, None] // 10**place) % 10
        out = np.where(pos < length[:, None], digits, np.where(pos == length[:, None], EOS, PAD))
        return out.astype(np.int32)

    def train_batch(
        self, seed: int, step: int, size: int, *, phase: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """``size`` training prompts; a pure function of (seed, phase, step)."""
        pool, _ = self._pairs()
        rng = np.random.default_rng([seed, phase, step])
        return self.encode(pool[rng.integers(0, len(pool), size)])

    def held_out_set(self) -> tuple[np.ndarray, np.ndarray]:
        return self.encode(self._pairs()[1])

    def score(self, tokens: jnp.ndarray, sums: jnp.ndarray) -> dict[str, jnp.ndarray]:
        """Reward, correctness and well-formedness of answers [B, max_new] (jittable)."""
        tokens = tokens.astype(jnp.int32)
        width = self.max_new
        is_eos = tokens == EOS
        has_eos = jnp.any(is_eos, axis=1)
        length = jnp.where(has_eos, jnp.argmax(is_eos, axis=1), width)  # digits before EOS
        pos = jnp.arange(width)[None, :]
        before = pos < length[:, None]
        digits_ok = jnp.all(jnp.where(before, tokens < 10, True), axis=1)
        well_formed = has_eos & (length >= 1) & (length <= self.digits + 1) & digits_ok
        place = jnp.where(before, length[:, None] - 1 - pos, 0)
        value = jnp.sum(jnp.where(before, jnp.clip(tokens, 0, 9) * 10**place, 0), axis=1)
        correct = well_formed & (value == sums)
        bonus = self.brevity * (width - (length + 1)) / width
        reward = jnp.where(correct, 1.0 + bonus, jnp.where(well_formed, self.format_credit, 0.0))
        return {
            "reward": reward.astype(jnp.float32),
            "correct": correct.astype(jnp.float32),
            "well_formed": well_formed.astype(jnp.float32),
        }
