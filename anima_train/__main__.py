"""`python -m anima_train …` == `anima-train …` (also what `accelerate launch -m anima_train` runs)."""

import sys

from anima_train.system import parent_watch

parent_watch.start_from_env()  # a worker of the ComfyUI node ends with ComfyUI (before anything heavy loads)

from anima_train.cli import main  # noqa: E402

sys.exit(main())
