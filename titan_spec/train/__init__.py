"""How a run starts: ``python -m titan_spec.train`` on every rank, under torchrun.

    __main__.py   ``python -m titan_spec.train --config FILE [--section.key value ...]``
    entry.py      ``main`` (``--plan`` / ``--check`` through the preflight, then one run) and
                  ``train_and_close`` (build, train, export, close)
    launch.py     ``python -m titan_spec.train.launch``: torchrun with a failed rank reported
                  in one line (what run_train.sh starts)

Nothing is imported here: the launcher (torch only) does not pay for the entry's imports.
"""
