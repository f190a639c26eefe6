"""``python -m gpufleet`` runs the command line."""

from gpufleet.cli import main

main()
