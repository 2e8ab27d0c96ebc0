"""The `tandem` subcommands: each module has `register(subparsers)` and translates flags only."""
