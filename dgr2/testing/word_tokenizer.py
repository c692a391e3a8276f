"""A 17-word ``PreTrainedTokenizerFast`` for harness tests (special tokens + ``w0..w11``).

Why here: the training-harness and training-reliability tests both need the same tiny, saved
tokenizer with every special token the stages read (pad, bos, eos, mask).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def word_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """Build the tokenizer, save it to ``directory`` and return it."""
    words = ["<pad>", "<unk>", "<s>", "</s>", "<mask>"] + [f"w{i}" for i in range(12)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
        eos_token="</s>", mask_token="<mask>",
    )
    hf.save_pretrained(directory)
    return hf
