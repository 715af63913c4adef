"""``python -m trioserve.client``: the terminal chat (:mod:`trioserve.client.chat`)."""

import sys

from .chat import main

sys.exit(main())
