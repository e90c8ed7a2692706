import sys

from chatserve.cli import main

sys.exit(main())
