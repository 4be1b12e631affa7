"""``python -m evoharness.cli``: how DVC's stage commands run the library's command line."""

from evoharness.cli import main

main()
