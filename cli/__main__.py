import sys

from prismlb.cli import main

sys.exit(main())
