"""The shipped text dataset as (tokens, targets) batches for the toy LMs.

Documents are tokenized with the shipped BPE tokenizer, joined with end-of-text tokens into
one stream and cut into rows of ``seq + 1`` tokens; a batch is ``batch`` consecutive rows
(targets are the rows shifted by one). Deterministic for a given seed; wraps around.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

__all__ = ["ASSETS", "TextBatches", "vocab_size", "token_stream"]

ASSETS = Path(__file__).parent / "assets"


@lru_cache(maxsize=4)
def _tokenizer(path: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def vocab_size(tokenizer_path: Path = ASSETS / "tokenizer.json") -> int:
    return _tokenizer(str(tokenizer_path)).get_vocab_size()


@lru_cache(maxsize=4)
def token_stream(corpus_path: str = str(ASSETS / "corpus.jsonl"),
                 tokenizer_path: str = str(ASSETS / "tokenizer.json")) -> torch.Tensor:
    tokenizer = _tokenizer(tokenizer_path)
    eos = tokenizer.token_to_id("<|end_of_text|>")
    with open(corpus_path) as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


class TextBatches:
    """Iterator of ``(tokens, targets)``, each ``[batch, seq]`` int64."""

    def __init__(self, batch: int, seq: int, seed: int = 0, stream: torch.Tensor | None = None):
        self.batch, self.seq = batch, seq
        tokens = token_stream() if stream is None else stream
        rows = (len(tokens) - 1) // seq
        self.rows = torch.stack([tokens[i * seq:(i + 1) * seq + 1] for i in range(rows)])
        self.order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
        self.cursor = 0

    def __iter__(self) -> "TextBatches":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.order[(self.cursor + torch.arange(self.batch)) % len(self.order)]
        self.cursor += self.batch
        rows = self.rows[idx]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
