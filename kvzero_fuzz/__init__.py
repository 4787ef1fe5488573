"""The distribution's own top-level name: what must load before ``fuzz``, ``repro`` and ``zeroer``.

Those three names are generic (other projects on PyPI use them), so the pytest entry point lives
here, under a name no one else installs: :mod:`kvzero_fuzz.pytest_plugin` checks that the three
resolve to this distribution's packages (:mod:`kvzero_fuzz.shadowing`) before it loads
:mod:`fuzz.plugin`.
"""
