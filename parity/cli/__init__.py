"""The command line: ``main`` (``parity``/``python -m parity``, the COMMANDS table), ``options``
(options shared by the CLI and the pytest plugin), ``commands/`` (one module per subcommand,
``add_parser(sub)`` + ``run(args)``). May import: every stage below it (report, judge, run,
bundle, base).
"""
