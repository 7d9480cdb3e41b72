"""`python -m pagedkv` runs the CLI."""

import sys

from pagedkv.cli import main

sys.exit(main())
