"""`python -m kvcanary.cli`."""

import sys

from kvcanary.cli import main

sys.exit(main())
