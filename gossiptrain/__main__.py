"""`python -m gossiptrain` is the `gossiptrain` command."""

from .cli import console_main

console_main()
