"""``python -m coserve`` runs the command line."""

import sys

from coserve.cli import main

sys.exit(main())
