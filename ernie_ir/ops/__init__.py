"""The op set. Importing this package registers every op module it contains.

Adding an op is a one-file change: drop a module here whose op classes are
decorated with `@register_op`; it is imported below by discovery.
"""

from __future__ import annotations

import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    if not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")
