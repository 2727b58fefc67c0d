"""The `sartor` command line: one module per subcommand, `main.py` ties them together."""
