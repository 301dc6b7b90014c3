"""Reports of a comparison: ``text`` (the table and the text report), ``markdown``, ``json_report``,
``junit``, ``html``, ``error_report`` (the reports of a run that could not finish), ``show`` (what
a bundle holds). Numbers are written by :mod:`parity.base.numbers`.
May import: ``parity.judge`` and every stage below it.
"""
