"""`python -m gossiptrain` is the `gossiptrain` command."""

import sys

from .cli import main

sys.exit(main())
