"""Train the sample models' byte-level BPE tokenizer on the standard library's Python sources.

Run from the repository root (CPU, about a minute)::

    python -m samples.train_tokenizer --out samples/tokenizer

Writes ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``, loadable
with ``transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)``.
Byte-level means every string round-trips exactly: ``decode(encode(s)) == s``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from samples.corpus import list_stdlib_files, read_texts

__all__ = ["EOS_TOKEN", "PAD_TOKEN", "VOCAB_SIZE", "train_tokenizer", "save_tokenizer"]

VOCAB_SIZE = 4096
EOS_TOKEN = "<|endoftext|>"  # id 0: end of text, also used as BOS
PAD_TOKEN = "<|pad|>"  # id 1
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN]


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE tokenizer of ``vocab_size`` ids; the special tokens take ids 0 and 1."""
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: "def f" must encode to the same ids at the start of a prompt as inside one.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != token_id:
            raise RuntimeError(f"special token {token!r} did not get id {token_id}")
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int = 2048) -> None:
    """Write the three files ``transformers.AutoTokenizer`` reads from a local folder."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": EOS_TOKEN,
               "pad_token": PAD_TOKEN}  # fmt: skip
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
    }
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", special)


def _write_json(path: Path, obj: Mapping[str, object]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("samples/tokenizer"))
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)
    texts = [f.text for f in read_texts(list_stdlib_files(include_tests=False))]
    print(f"python {sys.version.split()[0]}: {len(texts)} files, "
          f"{sum(len(t) for t in texts) / 1e6:.1f} MB of text")  # fmt: skip
    tokenizer = train_tokenizer(texts, args.vocab_size)
    save_tokenizer(tokenizer, args.out)
    sample = texts[0][:2000]
    ids = tokenizer.encode(sample).ids
    print(f"vocab {tokenizer.get_vocab_size()}, {len(sample) / len(ids):.2f} chars/token "
          f"on a sample; wrote {args.out}")  # fmt: skip


if __name__ == "__main__":
    main()
