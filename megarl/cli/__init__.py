"""The `megarl` command line: one module per sub-command (see main.COMMANDS)."""
