import sys

from thunderpool.cli import main

sys.exit(main())
