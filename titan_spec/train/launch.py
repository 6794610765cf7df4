"""torchrun, as run_train.sh starts it, with titan_spec's one-line failures kept one line.

    python -m titan_spec.train.launch [torchrun arguments] -m titan_spec.train --config FILE ...

``torch.distributed.run.main`` (what ``python -m torch.distributed.run`` runs) reports a
failed rank with a ~50-line ChildFailedError report: the launcher's traceback, the rank's
recorded error file and traceback. Where the rank already said what stopped it in one line
(a config error, a finiteness stop, a checkpoint it cannot read or write, a reward that raised:
``report_stop`` below, which the rank calls, writes that line to the rank's error file) that
report is noise, so this runs the same ``run`` without it and prints that line, once; any
other failure (a crash) prints one line naming the rank, its exit code and its error, whose
traceback the rank printed (LOG_RANK picks whose output is shown). A signal that stops torchrun (run_train.sh
forwards SIGTERM) ends it with 128 + the signal's number, quietly: the script says why.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

__all__ = ["main", "report_stop"]

# Set for the ranks main starts (they inherit it): report_stop then hands their line back here.
_LAUNCHED = "TITAN_SPEC_LAUNCHED"
# Marks an error file that holds such a line rather than a crash's traceback.
_LINE = "titan_spec_line"


def report_stop(line: str) -> None:
    """The one line of a rank that stops on purpose (titan_spec/train/entry.py: a config error,
    a finiteness stop, a checkpoint it cannot read or write, a reward that raised).

    Under main, the line goes to this rank's torchrun error file, in the format torchrun's
    ProcessFailure reads (replacing the traceback torchtitan's ``@record`` wrote there), and
    main prints it once: printed by the rank, it could be lost, since torchrun stops the other
    ranks as soon as one exits, before they print. Otherwise (plain torchrun, no torchrun) the
    rank prints it."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if os.environ.get(_LAUNCHED) and error_file:
        with open(error_file, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time()), _LINE: True}, f)
        return
    sys.stderr.write(line + "\n")  # one write: each rank's line stays whole
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    # The elastic agent logs every failed rank at ERROR before raising: the same report again.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ[_LAUNCHED] = "1"  # the ranks inherit it: their one line comes back here
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.error_file_data.get(_LINE):
            print(failure.message, file=sys.stderr)
        elif failure.error_file != "<N/A>" or failure.exitcode < 0:  # a crash, or killed by a signal
            what = failure.message  # a str, or the error file's {"message": "Type: text", "extraInfo": ...}
            what = str(what.get("message", what) if isinstance(what, dict) else what).strip()
            what = what.splitlines()[-1] if what else "no error recorded"
            print(
                f"titan_spec: rank {rank} exited with code {failure.exitcode}: {what} (its output: LOG_RANK={rank})",
                file=sys.stderr,
            )
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
