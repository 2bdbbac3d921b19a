"""Checkpoints: the train state plus JSON metadata, saved with orbax's CheckpointManager.

The module moved into this package unchanged (`manager`); it is split along its seams next.
"""

from jaxdist.checkpoint.manager import *  # noqa: F403
from jaxdist.checkpoint.manager import _check_matches, _flatten  # noqa: F401
