"""`python -m anima_train …` == `anima-train …` (also what `accelerate launch -m anima_train` runs)."""

import sys

from anima_train.cli import main

sys.exit(main())
