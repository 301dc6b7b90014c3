"""The pytest side: ``plugin`` (options, fixtures, markers, the summary), ``goldens`` (the golden
lifecycle of a pytest check), ``strategies`` (Hypothesis strategies of attention cases).
May import: ``parity.cli.options`` and every stage below the command line.
"""
