"""The ``rlfleet`` command line (entry point ``cli.main:main``): one module per subcommand.

A client of the other packages; nothing imports it except the console script and its tests.
"""
