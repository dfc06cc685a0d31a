"""``python -m trident.report <sweep dir or jobs.csv>``: see :mod:`trident.report`."""

from trident.report.command import main

main()
