"""The arithmetic that collection and analysis share, on the floor below both: the union of intervals
(``intervals``) and nccl-tests' bus-bandwidth factors (``bus_factors``). Imports nothing of the tool."""
