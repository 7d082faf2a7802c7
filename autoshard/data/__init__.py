"""Training data: token files and text (`train --data`), or any iterable of batches (the API),
each rank reading its own rows.

`files` finds and memory-maps token files, `text` tokenizes text once (cached by content),
`corpus` cuts the stream into shuffled windows, `instruct` reads instruction JSONL (chats,
prompt/completion), `examples` lays its examples into packed or padded rows and
`instruction_feed` feeds them, `feed` opens and checks the data before planning and gives the
training steps each rank's inputs and the validation loss, `batches` takes a user's iterable.
Imports torch, numpy, `autoshard.options` and (for text) `datasets`, `tokenizers` and
transformers' chat-template renderer, never a planning stage. docs/data.md is the user's guide.
"""

from autoshard.data.batches import BatchesFeed
from autoshard.data.feed import (
    Corpus,
    CorpusFeed,
    DataConfig,
    Feed,
    Synthetic,
    SyntheticFeed,
    fitted_vocab,
    open_data,
    with_layout,
)
from autoshard.data.instruction_feed import InstructionFeed, Instructions

__all__ = [
    "BatchesFeed",
    "Corpus",
    "CorpusFeed",
    "DataConfig",
    "Feed",
    "InstructionFeed",
    "Instructions",
    "Synthetic",
    "SyntheticFeed",
    "fitted_vocab",
    "open_data",
    "with_layout",
]
