"""``python -m smthrs_plugin`` runs the ``smthrs`` command line."""

from .cli import main

main()
