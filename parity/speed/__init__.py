"""Speed: ``parity profile`` (where device time goes, by module, op and kernel) and ``parity bench``
(timing implementations, with a speedup valid only where parity holds).

- :mod:`.stats`: pure statistics of timing samples (median, IQR, bootstrap interval, verdicts, equivalence).
- :mod:`.profile`: running a subject under ``torch.profiler`` and the accounting of device time.
- :mod:`.importers`: kernel tables of rocprof v1, rocprofv3 and ``nsys stats``, read into the
  profile's kernel view.
- :mod:`.bench`: timing implementations and gating each speedup on a parity verdict;
  :mod:`.timing`: its rounds, cache flush, fresh outputs and module hooks; :mod:`.clocks`: the
  device's clock and throttling reasons during the rounds; :mod:`.regression`: a run against a
  saved one (``--baseline``): the saved report read as data, the same-setup check, REGRESSED.
- :mod:`.tables`: the text reports; :mod:`.pages`: the HTML pages.
"""
