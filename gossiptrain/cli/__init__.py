"""The ``gossiptrain`` command: one module per subcommand; nothing imports this package."""
