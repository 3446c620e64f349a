"""`ArithmeticCorpus`: a synthetic corpus ("12+7=19") that a small GPT learns in a few hundred CPU steps."""

from __future__ import annotations

import random
from collections.abc import Callable

from loom.train.data.tokenize import ByteTokenizer
from loom.train.data.windows import Batch, check_seq_len, window

__all__ = ["ArithmeticCorpus"]


class ArithmeticCorpus:
    """Synthetic arithmetic in bytes: lines such as `"12+7=19\\n"` and `"40-13=27\\n"`, packed into windows.

    The task: operands are uniform integers in `[0, max_operand]`; `ops` picks among addition and
    subtraction (the larger operand comes first, so results are never negative). Sample `i` is the first
    `seq_len + 1` bytes of a run of fresh lines drawn from a generator seeded with `(seed, i)` only, so it
    never depends on what was read before, on the rank or on the process; each window starts at a line.
    The question digits are random (unlearnable), the answer digits after `=` are a function of the
    question: that is what a model learns, and what `accuracy` measures by exact match on prompts drawn
    from another seed (with small operands every fact also occurs in training: this tests learning, not
    generalisation).
    The default, single-digit operands, is what a small model learns in a few hundred CPU steps: with 32
    sequences of 32 tokens per step and AdamW at 3e-3 (cosine), a byte-level GPT with d_model=128 answered
    about 55% of 200 prompts exactly after 300 steps with 2 layers (0.44M parameters) and about 80%
    with 4 layers (0.83M). Operands up to 19 or 99 stayed under 15% after 300 steps: they need longer runs.

    Token ids are bytes (vocab 256): use `ByteTokenizer` to encode prompts and decode generations.
    """

    def __init__(
        self, seq_len: int, seed: int = 0, *, max_operand: int = 9, ops: str = "+-", size: int = 1_000_000
    ) -> None:
        check_seq_len(seq_len)
        if not isinstance(max_operand, int) or max_operand < 1:
            raise ValueError(f"max_operand must be an integer >= 1, got {max_operand!r}")
        if not ops or set(ops) - {"+", "-"}:
            raise ValueError(f"ops {ops!r} must be made of '+' and '-', e.g. '+' or '+-'")
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.seq_len, self.seed, self.max_operand, self.ops, self.size = seq_len, seed, max_operand, ops, size
        self.tokenizer = ByteTokenizer()

    def __len__(self) -> int:
        # The corpus is unbounded; `size` only gives shuffling and epochs something finite to count.
        return self.size

    def _problem(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = rng.choice(self.ops)
        if op == "-":
            a, b = max(a, b), min(a, b)
            return f"{a}-{b}=", str(a - b)
        return f"{a}+{b}=", str(a + b)

    def text(self, index: int) -> str:
        """The `seq_len + 1` characters of sample `index`."""
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} out of range for {self.size} samples")
        # A string seed is hashed with SHA-512 by `random`, the same in every process (unlike hash()).
        rng = random.Random(f"loom-arithmetic:{self.seed}:{index}")
        parts, length = [], 0
        while length < self.seq_len + 1:
            prompt, answer = self._problem(rng)
            parts.append(f"{prompt}{answer}\n")
            length += len(parts[-1])
        return "".join(parts)[: self.seq_len + 1]

    def __getitem__(self, index: int) -> Batch:
        return window(self.tokenizer.encode(self.text(index)), 0, self.seq_len)

    def prompts(self, n: int, seed: int | None = None) -> list[tuple[str, str]]:
        """`n` evaluation pairs such as `("12+7=", "19")`, from `seed` (default: the corpus seed)."""
        rng = random.Random(f"loom-arithmetic-prompts:{self.seed if seed is None else seed}")
        return [self._problem(rng) for _ in range(n)]

    @property
    def max_answer_tokens(self) -> int:
        """Tokens an answer may take, with its closing newline."""
        return len(str(2 * self.max_operand)) + 1

    def accuracy(
        self, generate: Callable[[list[str], int], list[str]], n: int = 100, seed: int | None = None
    ) -> float:
        """Exact-match accuracy of `generate(prompts, max_new_tokens) -> texts` (one text per prompt, all
        asked at once so that a model decodes them as one batch) on `n` prompts.

        A generated text is read up to its first newline; a generation that repeats the prompt first is
        accepted too (the prompt is stripped).
        """
        if n < 1:
            raise ValueError(f"accuracy needs n >= 1 prompts, got {n}")
        pairs = self.prompts(n, seed)
        outputs = generate([prompt for prompt, _ in pairs], self.max_answer_tokens)
        if len(outputs) != len(pairs):
            raise ValueError(f"generate answered {len(outputs)} texts for {len(pairs)} prompts")
        correct = 0
        for (prompt, answer), out in zip(pairs, outputs, strict=True):
            out = out.removeprefix(prompt)
            correct += out.split("\n", 1)[0].strip() == answer
        return correct / n
