"""What every kvlab command line shares: bad input is reported as one `error: ...` line and a
non-zero exit, never a traceback (set KVLAB_DEBUG=1 to get the traceback)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from checkpoint import CheckpointError
from model import ConfigError

USER_ERRORS = (CheckpointError, ConfigError, ValueError, FileNotFoundError)


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line instead of usage + error."""

    def error(self, message: str) -> None:
        self.exit(2, f"error: {message} (see --help)\n")


def run_cli(fn: Callable[[argparse.Namespace], None], args: argparse.Namespace) -> None:
    try:
        fn(args)
    except USER_ERRORS as e:
        if os.environ.get("KVLAB_DEBUG"):
            raise
        sys.exit(f"error: {e}")
