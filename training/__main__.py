"""``python -m training --target DIR --prompts FILE --out RUN`` (see training/cli.py)."""

import logging
import sys

from training.cli import main

if __name__ == "__main__":
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    log = logging.getLogger("training")  # training.data etc. log through it
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        main(sys.argv[1:])
    except ValueError as err:  # a setting or input the user can fix: say which, no trace
        sys.exit(f"python -m training: error: {err}")
