"""Text data in WikiText format (whitespace-separated words, one paragraph a line): a vocabulary
built from the training file, and batches for language modelling ('lm') or masked language
modelling ('mlm'). Any file of this format works; tests use shared/data/wikitext-2/."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hidup.models.bert import mask_tokens

MASK, UNK, EOS = "<mask>", "<unk>", "<eos>"


class DataError(ValueError):
    """A data file is missing, empty or unusable."""


@dataclass(frozen=True)
class Vocabulary:
    words: tuple[str, ...]
    index: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.index.update({w: i for i, w in enumerate(self.words)})

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, words) -> list[int]:
        unk = self.index[UNK]
        return [self.index.get(w, unk) for w in words]


def _words(path: Path) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read text file {path}: {exc}") from exc
    words = [w for line in text.splitlines() if line.strip() for w in line.split() + [EOS]]
    if not words:
        raise DataError(f"text file {path} has no words; give a WikiText-format file "
                        f"(whitespace-separated words, one paragraph a line)")
    return words


def build_vocabulary(path: Path) -> Vocabulary:
    """Every word of the training file, in order of first appearance, after <mask> and <unk>."""
    words = dict.fromkeys([MASK, UNK, EOS])
    words.update(dict.fromkeys(_words(path)))
    return Vocabulary(tuple(words))


def load_tokens(path: Path, vocab: Vocabulary) -> torch.Tensor:
    return torch.tensor(vocab.encode(_words(path)), dtype=torch.int64)


def batch_at(tokens: torch.Tensor, task: str, batch: int, seq: int, starts: torch.Tensor,
             gen: torch.Generator) -> tuple:
    """Model inputs for sequences starting at `starts`: (tokens, next tokens) for 'lm', (masked
    tokens, original tokens, mask weights) for 'mlm'."""
    rows = torch.stack([tokens[s: s + seq + 1] for s in starts.tolist()])
    if task == "lm":
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    if task == "mlm":
        return mask_tokens(rows[:, :-1].contiguous(), 0, gen)
    raise DataError(f"text data is for language models ('lm', 'mlm'); this model's task is {task!r}")


def random_batch(tokens, task, batch, seq, gen) -> tuple:
    if len(tokens) <= seq + 1:
        raise DataError(f"the text has {len(tokens)} tokens, too few for sequences of {seq}")
    starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=gen)
    return batch_at(tokens, task, batch, seq, starts, gen)


def eval_batches(tokens, task, batch, seq, limit: int):
    """Consecutive, non-overlapping sequences from the start of the held-out text."""
    per_batch = batch * seq
    n = min(limit, (len(tokens) - 1) // per_batch)
    if n < 1:
        raise DataError(f"the evaluation text has {len(tokens)} tokens, too few for one batch of "
                        f"{batch} x {seq}")
    gen = torch.Generator().manual_seed(1234)
    for i in range(n):
        starts = torch.arange(batch) * seq + i * per_batch
        yield batch_at(tokens, task, batch, seq, starts, gen)


def perplexity(mean_loss: float) -> float:
    return math.exp(min(mean_loss, 700.0))
