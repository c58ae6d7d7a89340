"""``python -m spmd`` is the ``spmd`` command."""

import sys

from spmd.cli import main

sys.exit(main())
