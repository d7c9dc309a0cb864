"""Train a byte-level BPE tokenizer with Gemma-style special tokens (the `tokenizers` library).

The specials come first, at the ids every dgemma checkpoint uses (<pad>=0, <eos>=1, <bos>=2,
<unk>=3, <mask>=4, <|turn>=5, <turn|>=6, ...), then the 256 byte symbols, then the merges, so any
text round-trips and the chat template's turn markers are single tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from ..inputs.tokenizer import Tokenizer
from ..model.checkpoint import SPECIAL_TOKENS


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> HFTokenizer:
    """A byte-level BPE of `vocab_size` tokens (specials included) learned from `texts`."""
    floor = len(SPECIAL_TOKENS) + 256
    if vocab_size < floor:
        raise ValueError(f"vocab_size must be at least {floor} (specials + 256 bytes), got {vocab_size}")
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i, f"special token {name} landed at {tok.token_to_id(name)}"
    return tok


def as_tokenizer(tok: HFTokenizer) -> Tokenizer:
    """Wrap a raw `tokenizers` object with dgemma's defaults (<bos>, <eos>, <pad>, the Gemma chat template)."""
    return Tokenizer(tok, {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"})
