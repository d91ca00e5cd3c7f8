"""Tuned launch configurations: measured per GPU, consulted before the heuristic.

=========  ==================================================================
``table``  the JSON table of one GPU: its format, where it is found, how it is
           checked, and the lookup among the nearest entries the launcher consults
``sweep``  ``python -m punica_numba tune``: check and time every configuration
           over a grid of problems, and write this GPU's table
``near``   ``tune --near N``: a problem timed under the picks of its N nearest
           entries and the heuristic's, not every configuration
``report`` ``tune --report``: the heuristic's time over the fastest, per problem
           of a table, and the lookup's with each problem left out (with
           ``--near``, what that short list would lose)
=========  ==================================================================

The launcher (:func:`punica_numba.launch.choose_launch_config`) takes a forced
configuration first, then the tuned table's (where the call can use it; a GPU without a
table of its own can be told to read one of its compute capability's, and
:func:`tuned_table_gpu` says whose), then its hand-written heuristic. Only :mod:`.table` is
imported here: :mod:`.sweep` runs the ops and is loaded by the command line alone.
"""

from .table import (
    CONFIG_DIR_VARIABLE,
    FALLBACK_VARIABLE,
    TunedTableError,
    read_table,
    reload_tuned_tables,
    tuned_config,
    tuned_table_gpu,
    tuned_table_path,
    write_table,
)

__all__ = [
    "CONFIG_DIR_VARIABLE",
    "FALLBACK_VARIABLE",
    "TunedTableError",
    "read_table",
    "reload_tuned_tables",
    "tuned_config",
    "tuned_table_gpu",
    "tuned_table_path",
    "write_table",
]
