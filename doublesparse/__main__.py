"""``python -m doublesparse <subcommand>``."""

import sys

from doublesparse.cli import main

sys.exit(main())
