"""`python -m gossiptrain` is the `gossiptrain` command."""

from gossiptrain.cli.main import console_main

console_main()
