"""The figures of ``just bench``, one module each, run by ``benchmarks/run.py``.

Each module has ``NUMBER``, ``FULL`` and ``QUICK`` (its parameters in each mode),
``run(quick) -> dict`` (measures, writes results/figN_*.json and .png, returns the data,
whose ``method`` says how it was measured) and ``report(data) -> (lines, rows)``: its
section of the summary and its rows of the summary table
(``[figure, ratio (this run), value, how measured]``).
"""
