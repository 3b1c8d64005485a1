"""Build the small text dataset and BPE tokenizer that ship with Piper (offline, deterministic).

The corpus is generated from templates about pipelines, rivers and workshops so that a tiny
model has structure to learn; the tokenizer is a byte-level BPE trained on it with the
``tokenizers`` library. Run ``python -m piper_plugin.data.build_assets`` to rebuild both.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
VOCAB_SIZE = 512

_SUBJECTS = ["the pipeline", "a worker", "the scheduler", "each stage", "the river", "a small boat",
             "the old miller", "the apprentice", "every rank", "the first stage", "the last stage",
             "a careful engineer", "the optimizer", "the garden", "a quiet village"]
_VERBS = ["sends", "receives", "carries", "waits for", "computes", "gathers", "shares", "repairs",
          "measures", "follows", "prepares", "counts", "splits", "joins", "returns"]
_OBJECTS = ["the activations", "a microbatch", "the gradients", "fresh water", "the heavy stones",
            "a bundle of letters", "the weights", "the morning bread", "the next message",
            "a list of tasks", "the evening lanterns", "the loss", "a copy of the plan"]
_ENDINGS = ["before the bell rings", "along the narrow path", "in the same order every day",
            "without losing a single piece", "while the others rest", "as the plan says",
            "to the stage after it", "back to the stage before it", "when the river is calm",
            "and writes down the time"]
_CONNECT = ["then", "after that", "meanwhile", "so", "and later"]


def _sentence(rng: random.Random) -> str:
    clause = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}"
    if rng.random() < 0.4:
        clause += f", {rng.choice(_CONNECT)} {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    return clause[0].upper() + clause[1:] + "."


def make_corpus(documents: int = 2000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(_sentence(rng) for _ in range(rng.randint(3, 8))) for _ in range(documents)]


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def main() -> None:
    ASSETS.mkdir(exist_ok=True)
    texts = make_corpus()
    with open(ASSETS / "corpus.jsonl", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    train_tokenizer(texts).save(str(ASSETS / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": False,
              "model_max_length": 4096}
    (ASSETS / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    print(f"wrote {len(texts)} documents and a {VOCAB_SIZE}-token BPE tokenizer to {ASSETS}")


if __name__ == "__main__":
    main()
