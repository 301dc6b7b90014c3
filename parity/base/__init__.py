"""The foundation every stage uses: errors and exit statuses, the dtype vocabulary, printable text,
atomic report files, ``KEY=VALUE`` overrides, JSON envelopes and one number formatter.

May import: the kernel layer (``parity.kernels``) and nothing else of parity.
"""
