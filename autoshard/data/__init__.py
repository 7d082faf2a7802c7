"""Training data from files (`train --data`): token files and text, each rank reading its own rows.

`files` finds and memory-maps token files, `text` tokenizes text once (cached by content),
`corpus` cuts the stream into shuffled windows, `feed` gives the training steps each rank's inputs
and the validation loss. Imports torch, numpy, `autoshard.options` and (for text) `datasets` and
`tokenizers`, never a planning stage. docs/data.md is the user's guide.
"""

from autoshard.data.feed import CorpusFeed, Feed, SyntheticFeed, open_feed

__all__ = ["CorpusFeed", "Feed", "SyntheticFeed", "open_feed"]
