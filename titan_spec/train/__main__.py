"""``python -m titan_spec.train --config FILE [--section.key value ...]``: one rank's run
(titan_spec/train/entry.py ``main``); the process ends through ``platform.exit_process``."""

from titan_spec import platform
from titan_spec.train.entry import main

platform.exit_process(main())
