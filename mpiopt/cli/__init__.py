"""Command-line interface: ``python -m mpiopt <command>`` (``--help`` lists them)."""
