"""The measuring kit of ``benchmarks/``: the code the benchmark scripts share (the HLO walker,
the compiled functions and their floors, the bench model and its checkpoint, timing, the
decode and update cells, the GPU suite's cells). The scripts import it as ``benchmarks.kit``;
it imports the library, ``models`` and itself, never a script (``tests/test_layout.py``).
``benchmarks/README.md`` lists its modules."""
