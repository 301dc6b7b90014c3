"""Optional integrations with other libraries.

Each integration is a submodule that imports its library only when it is itself imported
(``import parity.integrations.transformers``); importing ``parity`` or this package never needs
them. Install the matching extra: ``pip install 'parity[transformers]'``.
"""
