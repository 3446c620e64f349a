"""The `loom` command line: `loom.cli.main.main` parses, one module per subcommand does the work.

Nothing is imported here, so that `python -m loom.cli.main` runs the module only once.
"""
