"""Loading a checkpoint's tokenizer for decoding only. The fast `tokenizers` library reads
tokenizer.json without importing torch or transformers, which keeps the scheduler and
detokenizer processes light; other formats fall back to transformers."""

from __future__ import annotations

from pathlib import Path


def load_decoder(model_dir: str):
    path = Path(model_dir) / "tokenizer.json"
    if path.exists():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
