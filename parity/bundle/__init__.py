"""The bundle: a directory of safetensors shards plus ``manifest.json``.

``manifest`` (the schema, checked strictly), ``checksums``, ``shards`` (the safetensors format),
``writer`` (shards through a ring of reused memory), ``commit`` (moving a bundle into place with
renameat2 or a journal, and recovering after a killed writer), ``reader`` (checked, verified
reading). May import: ``parity.base``.
"""
