"""Megatron's own data path over the corpus and tokenizer Piper ships (offline by default).

* :func:`shipped_corpus` tokenizes ``piper_plugin/data/assets/corpus.jsonl`` with the shipped
  BPE tokenizer into Megatron's indexed dataset (``<prefix>.bin`` / ``<prefix>.idx`` written
  by ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder``, one document per line
  with an end-of-text token appended, as Megatron-LM's ``preprocess_data.py --append-eod``);
  built once per cache folder, by global rank 0, the others wait at a barrier;
* :func:`train_dataset` reads a prefix (shipped or ``--data-path``) with ``GPTDataset``
  through ``BlendedMegatronDatasetBuilder``;
* :class:`PretrainingBatches` serves one data-parallel rank its microbatches in Megatron-LM's
  pretraining-sampler order: global batch ``k`` is samples ``[k * G, (k + 1) * G)``; within
  it microbatch ``i`` of data-parallel rank ``r`` is the ``micro_batch_size`` samples starting
  at ``(i * dp + r) * micro_batch_size`` (Megatron-LM cuts each ``micro_batch_size * dp`` run of
  samples across the data-parallel ranks). ``consumed_samples`` is its position (checkpointed).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["ShippedTokenizer", "shipped_corpus", "train_dataset", "split_datasets", "PretrainingBatches",
           "chunk_iterators", "ASSETS"]

import piper_plugin as _piper

ASSETS = Path(_piper.__file__).resolve().parent / "data" / "assets"
_PREFIX = "piper_corpus_text_document"


class ShippedTokenizer:
    """The shipped BPE tokenizer (a ``tokenizers`` file) as Megatron's datasets read a tokenizer:
    ``eod``, ``vocab_size``, ``tokenize`` / ``detokenize`` and identifiers for its cache keys."""

    def __init__(self, path: Path = ASSETS / "tokenizer.json"):
        from tokenizers import Tokenizer

        self.path = Path(path)
        self._tokenizer = Tokenizer.from_file(str(self.path))
        self.eod = self._tokenizer.token_to_id("<|end_of_text|>")
        self.unique_identifiers = {"class": type(self).__name__, "tokenizer_path": [str(self.path)]}

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    @property
    def vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab()

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {v: k for k, v in self.vocab.items()}

    @property
    def eos(self) -> int:
        return self.eod

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(texts)]

    def detokenize(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids))


def _cache_dir() -> Path:
    return Path(os.environ.get("PIPER_CACHE", Path.home() / ".cache" / "piper")) / "megatron"


def shipped_corpus(tokenizer: ShippedTokenizer, cache: Path | None = None) -> str:
    """The shipped corpus as a Megatron indexed dataset; returns its path prefix."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    folder = Path(cache) if cache is not None else _cache_dir()
    prefix = folder / _PREFIX
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and not (prefix.with_suffix(".idx").exists() and prefix.with_suffix(".bin").exists()):
        folder.mkdir(parents=True, exist_ok=True)
        with open(ASSETS / "corpus.jsonl") as f:
            texts = [json.loads(line)["text"] for line in f if line.strip()]
        partial = folder / f"{_PREFIX}.{os.getpid()}"  # written whole, then renamed: never half a file
        builder = IndexedDatasetBuilder(str(partial) + ".bin", dtype=np.int32)
        for ids in tokenizer.tokenize_batch(texts):
            document = torch.tensor(ids + [tokenizer.eod], dtype=torch.int32)
            builder.add_document(document, [len(document)])
        builder.finalize(str(partial) + ".idx")
        os.replace(str(partial) + ".bin", prefix.with_suffix(".bin"))
        os.replace(str(partial) + ".idx", prefix.with_suffix(".idx"))
    if dist.is_initialized():
        dist.barrier()
    return str(prefix)


def train_dataset(prefix: str, tokenizer: Any, *, seq_length: int, samples: int, seed: int):
    """Megatron's ``GPTDataset`` over ``prefix`` with at least ``samples`` training samples (every
    document trains)."""
    return split_datasets(prefix, tokenizer, seq_length=seq_length, samples=(samples, 0, 0), seed=seed)[0]


def split_datasets(prefix: str, tokenizer: Any, *, seq_length: int, samples: tuple[int, int, int], seed: int,
                   split: str = "100,0,0") -> tuple[Any, Any, Any]:
    """Megatron's train, validation and test ``GPTDataset`` s over ``prefix``, the documents split
    by Megatron-LM's ``split`` weights, with at least ``samples`` samples each (None where a
    count or a weight is 0)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    if not Path(prefix + ".idx").exists() or not Path(prefix + ".bin").exists():
        raise FileNotFoundError(prefix)
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=([prefix], None), split=split,
        tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        path_to_cache=str(Path(prefix).parent / "index-cache"), mid_level_dataset_surplus=0.005)
    sizes = [n or None for n in samples]
    built = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return tuple(d if n else None for d, n in zip(built, sizes))


class PretrainingBatches:
    """Microbatches of one data-parallel rank, from ``consumed_samples`` on (see module doc)."""

    def __init__(self, dataset, *, micro_batch_size: int, dp_size: int, dp_rank: int, consumed_samples: int = 0):
        self.dataset, self.mbs, self.dp, self.rank = dataset, micro_batch_size, dp_size, dp_rank
        self.consumed_samples = consumed_samples

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        start = self.consumed_samples + self.rank * self.mbs
        samples = [self.dataset[(start + j) % len(self.dataset)] for j in range(self.mbs)]
        self.consumed_samples += self.mbs * self.dp
        return {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in samples[0]}


def chunk_iterators(dataset, chunks: list, *, micro_batch_size: int, dp_size: int, dp_rank: int,
                    consumed_samples: int):
    """One global batch's data iterator as Megatron's schedules take it: one
    :class:`PretrainingBatches` per model chunk (each chunk reads the same microbatches), the
    list with a virtual pipeline, else the one iterator."""
    iterators = [PretrainingBatches(dataset, micro_batch_size=micro_batch_size, dp_size=dp_size, dp_rank=dp_rank,
                                    consumed_samples=consumed_samples) for _ in chunks]
    return iterators if len(chunks) > 1 else iterators[0]
