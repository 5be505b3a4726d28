"""``python -m doublesparse.launch_server [engine flags] [--host --port --api-key ...]``."""

import sys

from doublesparse.server.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
