"""``python -m ivq_debug``: the ``ivq`` command."""

from ivq_debug.cli.main import main

main()
