"""The shared code of ``experiments/``: what the experiment scripts have in common (the
command line with run-config overrides, provenance, the arms of the walk experiment and its
run summaries and tables, the correction statistics' batches and gradient shares) and the
results pages' code (their data, verdicts, sections and assembly). The scripts import it as
``experiments.kit``; it imports the library, ``models`` and itself, never a script
(``tests/test_layout.py``). ``docs/layout.md`` lists its modules."""
