"""Show what a checkpoint holds: iteration, the layout it was saved with, model family and shape,
parameter count, size on disk and the run's arguments.

    python tools/checkpoint_info.py SAVE_DIR            # the newest complete checkpoint
    python tools/checkpoint_info.py SAVE_DIR/iter_0000100 --no-args
    python tools/checkpoint_info.py SAVE_DIR --ckpt-step 100 --json
"""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatrain.checkpoint.info import main  # noqa: E402

if __name__ == "__main__":
    main()
