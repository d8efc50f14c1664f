import sys

import thunderpool

thunderpool.hide_torch()  # before the CLI imports mlx-lm

from thunderpool.cli import main  # noqa: E402

sys.exit(main())
