"""``python -m stargrpc.cli``: the same as the ``stargrpc`` command."""

from stargrpc.cli import main

main()
