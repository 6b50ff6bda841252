"""Subcommand implementations: each module has add_arguments(parser) and run(args)."""
