#!/usr/bin/env python
"""Train a DFlash drafter for a target model: ``data``, ``train``, ``eval``, ``tau`` (``--help`` for each).

The trainer is the package ``ddtree_testkit.train_dflash`` (its docstring has the recipe and the H200 command).

    python tools/train_dflash.py train --target smollm2 --out .cache/models/dflash-smollm2-trained --steps 600
"""

import sys

from ddtree_testkit.train_dflash.cli import main

if __name__ == "__main__":
    sys.exit(main())
