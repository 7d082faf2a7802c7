"""The trainer: `train(settings, parts)` plans, applies and trains one run (the CLI's `train`
fills the settings from its flags); `Parts` hands in an optimizer, lr schedule, data or loggers of
one's own."""

from autoshard.train.loop import train
from autoshard.train.parts import Parts
from autoshard.train.settings import Settings

__all__ = ["Parts", "Settings", "train"]
