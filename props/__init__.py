"""Hypothesis differential fuzzing of every registered dualattn implementation.

Profiles (``DUALATTN_PROPS_PROFILE`` or ``pytest --props-profile``): ``ci`` (CPU, a few minutes),
``gpu`` (about 10 minutes on one GPU), ``campaign`` (long; one GPU per pytest-xdist worker).
"""
