"""torchrun, ending with one line where a rank fails: `python -m kvlab.launch --nproc_per_node 2 generate.py ...`.

It takes torchrun's own arguments and runs torchrun's launcher in this process. torchrun itself answers a
rank's failure with its own traceback and a table of ranks below the rank's one-line error; here the rank's
error stays the last thing that explains the failure, followed by one line naming the rank and its exit
status, which this process exits with; Ctrl-C ends with the ranks' own line and status 130. torchrun's
warnings that are not about the command (its note on OMP_NUM_THREADS, the signal it sends the other ranks)
are left out.
"""

from __future__ import annotations

import logging
import os
import sys

from kvlab import interrupts_quietly


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with `argv` (sys.argv's by default); the first failed rank's exit status, else 0."""
    with interrupts_quietly():
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import get_args_parser, run

    parser = get_args_parser()
    parser.prog = "python -m kvlab.launch"
    args = parser.parse_args(argv)
    if args.nproc_per_node.lstrip("-").isdigit() and int(args.nproc_per_node) < 1:
        print(f"error: --nproc_per_node must be >= 1 (or auto, cpu, gpu), got {args.nproc_per_node}", file=sys.stderr)
        return 2
    for name in list(logging.root.manager.loggerDict):  # each of torchrun's modules sets its own logger's level
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 1
        print(f"{e.name}: rank {rank} failed with exit status {failure.exitcode}", file=sys.stderr)
        return code
    except SignalException as e:  # Ctrl-C (or a kill): the ranks, which got it too, have said so in one line each
        return 128 + int(e.sigval)
    except Exception as e:  # the launcher itself failed before any rank ran (KVLAB_DEBUG=1: its traceback)
        if os.environ.get("KVLAB_DEBUG"):
            raise
        print(f"error: torchrun could not start the ranks: {str(e).strip() or type(e).__name__}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
