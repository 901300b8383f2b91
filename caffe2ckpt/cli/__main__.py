"""``python -m caffe2ckpt.cli``: the same as the ``caffe2ckpt`` console script."""

import sys

from caffe2ckpt.cli import main

sys.exit(main())
