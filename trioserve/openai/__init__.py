"""The OpenAI-compatible API as a pure core (:mod:`.api`): request bodies in,
typed requests out; responses, stream chunks and errors in OpenAI's shape.
No I/O, no trio, no torch."""

from .api import *  # noqa: F403
from .api import __all__ as __all__
